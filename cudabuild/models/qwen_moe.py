"""A Qwen3.5-MoE-style decoder in plain PyTorch, shaped for torch.export and AOTInductor.

Owns the architecture and the table of named sizes. Must not touch files (cudabuild/models/
checkpoint.py reads them), Hugging Face names (cudabuild/models/qwen_moe_hf.py maps them) or any
export or compile setting (recipes/qwen_moe.py declares those).

Every op is one Inductor generates code for itself (matmul, elementwise, reductions, softmax,
gather, cat, slice_scatter, index_copy_): no custom kernels, no topk/sort, no linalg, no sdpa, no
data-dependent shapes. `forward(tokens, input_pos)` traces one of two graphs:
- T == 1 (decode): the delta rule is the single-step recurrence; the experts' weights are gathered
  for the k chosen experts and reduced without materialising them.
- T >= 2 (prefill, T symbolic): the delta rule runs chunk-parallel (see `delta_rule_chunked`);
  the experts run as two dense matmuls over all experts, weighted by a sparse routing matrix.

Shape letters:
  B batch (1)        T new tokens        S max_seq_len (cache length)   N = B*T tokens
  D model dim        V vocab             H attention heads              G kv heads
  Dh head dim        R rotary dims       Hk, Hv delta-rule key, value heads  K key dim  Dv value dim
  C conv channels    W conv width        E experts   k experts a token  I expert hidden
  L delta-rule chunk n chunks
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int  # full attention: query heads
    n_kv_heads: int
    head_dim: int
    rope_fraction: float  # share of head_dim that is rotated
    rope_theta: float
    lin_k_heads: int  # gated delta rule: query/key heads
    lin_v_heads: int  # value heads (each key head serves lin_v_heads // lin_k_heads of them)
    lin_k_dim: int
    lin_v_dim: int
    conv_width: int
    n_experts: int
    top_k: int
    expert_dim: int
    shared_dim: int
    full_attn_every: int  # layer i is full attention when (i + 1) % full_attn_every == 0
    max_seq_len: int
    chunk: int  # delta-rule chunk length for prefill
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: torch.dtype = torch.float32  # of the weights (the delta-rule decay parameters stay fp32)
    hidden_act: str = "silu"  # of the experts and the shared expert (a key of ACTIVATIONS)
    # Rotary scaling, as Hugging Face's rope_parameters: "default", "linear" (positions / factor)
    # or "yarn" (frequencies blended between interpolation and extrapolation, cos/sin scaled).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max: int = 0  # yarn: the context length the model was trained at
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0  # yarn: the factor on cos and sin

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attn_every == 0

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.rope_fraction)

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def with_layers(self, n_layers: int) -> "ModelArgs":
        """These args cut to the first `n_layers` layers; 0 keeps them all."""
        if n_layers <= 0:
            return self
        return replace(self, n_layers=min(n_layers, self.n_layers))


# The named sizes. `tiny` exercises every feature (GQA, partial rotary, grouped delta-rule heads,
# 3 linear + 1 full layers, routed top-2 of 8 plus a gated shared expert) and lowers in seconds;
# `35b-a3b` has the real shapes of Qwen/Qwen3.5-35B-A3B (its config.json's text_config).
SIZES: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=1024, dim=128, n_layers=4,
        n_heads=4, n_kv_heads=2, head_dim=32, rope_fraction=0.25, rope_theta=10_000.0,
        lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, conv_width=4,
        n_experts=8, top_k=2, expert_dim=64, shared_dim=64,
        full_attn_every=2, max_seq_len=128, chunk=8, dtype=torch.float32,
    ),
    "35b-a3b": ModelArgs(
        vocab_size=248_320, dim=2048, n_layers=40,
        n_heads=16, n_kv_heads=2, head_dim=256, rope_fraction=0.25, rope_theta=10_000_000.0,
        lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, conv_width=4,
        n_experts=256, top_k=8, expert_dim=512, shared_dim=512,
        full_attn_every=4, max_seq_len=4096, chunk=64, dtype=torch.bfloat16,
    ),
}


# ---------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: the weight is an offset from one, x * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The delta-rule output norm: w * rmsnorm(x) * silu(z), with a plain (not offset) weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.type_as(x)
        return (y * F.silu(z.float())).type_as(x)


# hidden_act -> the function, as Hugging Face's ACT2FN names them.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
ROPE_TYPES = ("default", "linear", "yarn")


def rope_frequencies(a: ModelArgs, device) -> Tensor:
    """The inverse frequencies [R/2] of the rotary embedding, with the args' scaling applied
    (Hugging Face's `_compute_default/linear/yarn_parameters`)."""
    R = a.rope_dim
    inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, R, 2, device=device, dtype=torch.float32) / R))
    if a.rope_type == "linear":
        return inv_freq / a.rope_factor
    if a.rope_type == "yarn":
        def correction_dim(rotations: float) -> float:
            return (R * math.log(a.rope_original_max / (rotations * 2 * math.pi))) / (2 * math.log(a.rope_theta))

        low, high = correction_dim(a.rope_beta_fast), correction_dim(a.rope_beta_slow)
        if a.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, R - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(R // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # share of the unscaled frequency, per dim
        return (inv_freq / a.rope_factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R dims of each head (halves layout); x [B, T, H, Dh], cos/sin [T, R/2]."""
    R = 2 * cos.shape[-1]
    xr, xp = x[..., :R].float(), x[..., R:]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)
    return torch.cat([rotated, xp], dim=-1)


class KVCache(nn.Module):
    def __init__(self, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (1, n_kv_heads, max_seq_len, head_dim)  # [B, G, S, Dh]
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # In place at input_pos, so the caches stay mutated buffers of the exported program.
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    """GQA over a KV cache with QK-norm, partial rotary embedding and a sigmoid output gate."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        H, G, Dh, D = args.n_heads, args.n_kv_heads, args.head_dim, args.dim
        self.wq = nn.Linear(D, H * Dh * 2, bias=False, dtype=dtype)  # per head: [query | gate]
        self.wk = nn.Linear(D, G * Dh, bias=False, dtype=dtype)
        self.wv = nn.Linear(D, G * Dh, bias=False, dtype=dtype)
        self.wo = nn.Linear(H * Dh, D, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(Dh, args.norm_eps, dtype)
        self.k_norm = RMSNorm(Dh, args.norm_eps, dtype)
        self.kv_cache = KVCache(G, args.max_seq_len, Dh, dtype)

    def forward(self, x: Tensor, input_pos: Tensor) -> Tensor:
        a = self.args
        B, T, _ = x.shape
        H, G, Dh, S = a.n_heads, a.n_kv_heads, a.head_dim, a.max_seq_len
        qg = self.wq(x).view(B, T, H, 2 * Dh)
        q, gate = qg[..., :Dh], qg[..., Dh:]  # [B, T, H, Dh] each
        k = self.wk(x).view(B, T, G, Dh)
        v = self.wv(x).view(B, T, G, Dh)
        q, k = self.q_norm(q), self.k_norm(k)

        angles = input_pos.float()[:, None] * rope_frequencies(a, x.device)[None, :]  # [T, R/2]
        cos, sin = angles.cos(), angles.sin()
        if a.rope_attention_factor != 1.0:
            cos, sin = cos * a.rope_attention_factor, sin * a.rope_attention_factor
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        keys, values = self.kv_cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))  # [B, G, S, Dh]
        # Query heads g*rep .. g*rep+rep-1 share kv head g: fold them into the row dimension.
        rep = H // G
        qh = q.transpose(1, 2).reshape(B, G, rep * T, Dh)  # [B, G, rep*T, Dh]
        scores = (qh @ keys.transpose(-1, -2)).float() * (Dh**-0.5)  # [B, G, rep*T, S]
        visible = torch.arange(S, device=x.device)[None, :] <= input_pos[:, None]  # [T, S]
        scores = scores.view(B, G, rep, T, S).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).type_as(values).view(B, G, rep * T, S)
        # Split rows back into (rep, T) before merging (G, rep): one combined view trips export.
        y = (probs @ values).view(B, G, rep, T, Dh).permute(0, 3, 1, 2, 4).reshape(B, T, H * Dh)
        y = y * torch.sigmoid(gate.reshape(B, T, H * Dh))
        return self.wo(y)


# ---------------------------------------------------------------------------------------------
# Gated delta rule


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor):
    """One token of the gated delta rule.

    q, k [B, Hv, K]; v [B, Hv, Dv]; g (log decay), beta [B, Hv]; state [B, Hv, K, Dv].
    Returns the output [B, Hv, Dv] and the new state.
    """
    state = state * g.exp()[..., None, None]
    recalled = (state * k[..., None]).sum(-2)  # [B, Hv, Dv]
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def _unit_lower_inverse(A: Tensor, L: int) -> Tensor:
    """(I + A)^-1 for A strictly lower triangular [.., L, L]: A^L = 0, so the Neumann series is
    finite and equals prod_{j<J} (I + (-A)^(2^j)) with 2^J >= L: J matmuls, exact, no solver."""
    eye = torch.eye(L, dtype=A.dtype, device=A.device)
    power = -A
    inverse = eye + power
    for _ in range(max(0, math.ceil(math.log2(L)) - 1)):
        power = power @ power
        inverse = inverse @ (eye + power)
    return inverse


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, L: int, S: int):
    """The gated delta rule over T tokens at once, T symbolic, without a loop over tokens.

    q, k [B, Hv, T, K]; v [B, Hv, T, Dv]; g, beta [B, Hv, T]; state [B, Hv, K, Dv]; all fp32.
    L is the chunk length; S bounds T.

    The tokens are padded to n = ceil(S / L) chunks, a static count, so every shape past the
    padding is static (padding has beta = g = 0: it leaves the state alone). Inside a chunk the
    delta rule is the WY/UT closed form: with gamma the cumulative log decay,
    u = (I + A)^-1 (beta*v - beta*e^gamma*k S_in), A[i,j] = beta_i e^(gamma_i-gamma_j) k_i.k_j
    (j < i). Each chunk is then an affine map of its incoming state, S_out = P S_in + Q, and the
    incoming states of all chunks come from a log-depth (Hillis-Steele) scan over those maps.
    """
    B, Hv, T, K = k.shape
    Dv = v.shape[-1]
    n = -(-S // L)

    def chunked(x: Tensor) -> Tensor:  # [B, Hv, T, *] -> [B, Hv, n, L, *]
        # Written into zeros (not concatenated with n*L - T zeros): no tensor's size depends on T.
        padded = torch.slice_scatter(x.new_zeros(B, Hv, n * L, *x.shape[3:]), x, dim=2, start=0, end=T)
        return padded.view(B, Hv, n, L, *x.shape[3:])

    q, k, v, g, beta = chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    # Cumulative log decay as a matmul with a triangle of ones (Inductor has no CPU scan kernel).
    gamma = g @ causal.t().to(g.dtype)  # [B, Hv, n, L]
    # decay[i, j] = e^(gamma_i - gamma_j) for j <= i; masked before exp so it cannot overflow.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., L, L]
    strict = causal & ~torch.eye(L, dtype=torch.bool, device=q.device)
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    inverse = _unit_lower_inverse(A, L)  # [B, Hv, n, L, L]
    u0 = inverse @ (beta[..., None] * v)  # [B, Hv, n, L, Dv]
    w = inverse @ ((beta * gamma.exp())[..., None] * k)  # [B, Hv, n, L, K]: u = u0 - w S_in
    qk = (q @ k.transpose(-1, -2)) * decay  # [B, Hv, n, L, L]

    last = gamma[..., -1:]  # [B, Hv, n, 1]
    kd = k * (last - gamma).exp()[..., None]  # keys decayed to the chunk's end
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    P = last.exp()[..., None] * eye - kd.transpose(-1, -2) @ w  # [B, Hv, n, K, K]
    Qm = kd.transpose(-1, -2) @ u0  # [B, Hv, n, K, Dv]

    # Inclusive scan: after it, chunk c holds the composition of the maps of chunks 0..c.
    for level in range(math.ceil(math.log2(n)) if n > 1 else 0):
        d = 2**level
        P_prev = torch.cat([eye.expand(B, Hv, d, K, K), P[:, :, : n - d]], dim=2)
        Q_prev = torch.cat([Qm.new_zeros(B, Hv, d, K, Dv), Qm[:, :, : n - d]], dim=2)
        P, Qm = P @ P_prev, P @ Q_prev + Qm
    after = P @ state[:, :, None] + Qm  # [B, Hv, n, K, Dv]: the state after each chunk
    before = torch.cat([state[:, :, None], after[:, :, : n - 1]], dim=2)  # the state entering each

    u = u0 - w @ before  # [B, Hv, n, L, Dv]
    out = (q * gamma.exp()[..., None]) @ before + qk @ u  # [B, Hv, n, L, Dv]
    return out.view(B, Hv, n * L, Dv)[:, :, :T], after[:, :, -1]


class GatedDeltaNet(nn.Module):
    """Linear attention: a causal depthwise conv, then the gated delta rule over a [K, Dv] state."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        D, Hv, C, W = args.dim, args.lin_v_heads, args.conv_dim, args.conv_width
        value_dim = Hv * args.lin_v_dim
        self.w_qkv = nn.Linear(D, C, bias=False, dtype=dtype)  # channels: [q | k | v]
        self.w_z = nn.Linear(D, value_dim, bias=False, dtype=dtype)
        self.w_b = nn.Linear(D, Hv, bias=False, dtype=dtype)
        self.w_a = nn.Linear(D, Hv, bias=False, dtype=dtype)
        self.conv_w = nn.Parameter(torch.zeros(C, 1, W, dtype=dtype))  # Conv1d's [C, 1, W] layout
        # The decay parameters are tiny and sensitive (exp of exp): kept in fp32 whatever the dtype.
        self.A_log = nn.Parameter(torch.zeros(Hv, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.ones(Hv, dtype=torch.float32))
        self.norm = GatedRMSNorm(args.lin_v_dim, args.norm_eps, dtype)
        self.wo = nn.Linear(value_dim, D, bias=False, dtype=dtype)
        self.register_buffer("conv_state", torch.zeros(1, C, W - 1, dtype=dtype), persistent=False)
        self.register_buffer(
            "recurrent_state", torch.zeros(1, Hv, args.lin_k_dim, args.lin_v_dim, dtype=torch.float32), persistent=False
        )

    def forward(self, x: Tensor, input_pos: Tensor) -> Tensor:
        a = self.args
        B, T, _ = x.shape
        Hk, Hv, K, Dv, W = a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, a.conv_width
        # A call starting at position 0 starts a new sequence: forget the previous one's state.
        keep = (input_pos[0] != 0).to(torch.float32)

        # Causal depthwise conv over [last W-1 inputs, new inputs], written as W shifted products.
        xc = torch.cat([self.conv_state * keep.to(x.dtype), self.w_qkv(x).transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
        self.conv_state.copy_(xc[:, :, -(W - 1) :])
        wc = self.conv_w[:, 0, :].float()  # [C, W]
        conv = sum(xc[:, :, i : i + T].float() * wc[:, i : i + 1] for i in range(W))  # [B, C, T]
        qkv = F.silu(conv).transpose(1, 2)  # [B, T, C] fp32

        kd, vd = Hk * K, Hv * Dv
        q = qkv[..., :kd].reshape(B, T, Hk, K)
        k = qkv[..., kd : 2 * kd].reshape(B, T, Hk, K)
        v = qkv[..., 2 * kd :].reshape(B, T, Hv, Dv)
        # Key head h serves value heads h*rep .. h*rep+rep-1.
        rep = Hv // Hk
        q = l2norm(q)[:, :, :, None].expand(B, T, Hk, rep, K).reshape(B, T, Hv, K) * (K**-0.5)
        k = l2norm(k)[:, :, :, None].expand(B, T, Hk, rep, K).reshape(B, T, Hv, K)
        beta = torch.sigmoid(self.w_b(x).float())  # [B, T, Hv]
        g = -self.A_log.exp() * F.softplus(self.w_a(x).float() + self.dt_bias)  # [B, T, Hv] log decay

        state = self.recurrent_state * keep
        if T == 1:
            o, state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o[:, None]  # [B, 1, Hv, Dv]
        else:
            heads_first = [t.transpose(1, 2) for t in (q, k, v, g, beta)]
            o, state = delta_rule_chunked(*heads_first, state, L=a.chunk, S=a.max_seq_len)
            o = o.transpose(1, 2)  # [B, T, Hv, Dv]
        self.recurrent_state.copy_(state)

        z = self.w_z(x).view(B, T, Hv, Dv)
        y = self.norm(o.to(x.dtype), z)  # [B, T, Hv, Dv]
        return self.wo(y.reshape(B, T, vd))


# ---------------------------------------------------------------------------------------------
# Mixture of experts


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dtype: torch.dtype, act=F.silu):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=dtype)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=dtype)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=dtype)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed experts (softmax, then the k best renormalised) plus a sigmoid-gated shared expert."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        E, I, D = args.n_experts, args.expert_dim, args.dim
        self.router = nn.Linear(D, E, bias=False, dtype=dtype)
        self.w_gate_up = nn.Parameter(torch.zeros(E, 2 * I, D, dtype=dtype))  # per expert: [gate | up]
        # Stored [E, I, D] (Hugging Face's down_proj is [E, D, I]): then w_down.view(E*I, D) is
        # the dense prefill's second matmul and w_down[e] a contiguous block for decode.
        self.w_down = nn.Parameter(torch.zeros(E, I, D, dtype=dtype))
        self.act = ACTIVATIONS[args.hidden_act]
        self.shared = FeedForward(D, args.shared_dim, dtype, self.act)
        self.shared_gate = nn.Linear(D, 1, bias=False, dtype=dtype)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, D] -> the chosen experts [N, k] and their weights [N, k] (fp32, summing to one).

        Top-k as k rounds of max + mask: k is static, and no sort or topk kernel is needed.
        """
        E = self.args.n_experts
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [N, E]
        experts = torch.arange(E, device=x.device)
        remaining, picked, weights = probs, [], []
        for _ in range(self.args.top_k):
            p, e = remaining.max(dim=-1)  # [N]
            picked.append(e)
            weights.append(p)
            remaining = remaining.masked_fill(experts[None, :] == e[:, None], -1.0)
        w = torch.stack(weights, dim=-1)
        return torch.stack(picked, dim=-1), w / w.sum(-1, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        a = self.args
        B, T, D = x.shape
        E, I = a.n_experts, a.expert_dim
        xf = x.reshape(B * T, D)
        idx, w = self.route(xf)  # [N, k]
        if T == 1:
            # Decode: read only the k chosen experts. Multiply-and-sum lets Inductor fuse the
            # gather into the reduction instead of copying the experts' weights out first.
            h = (self.w_gate_up[idx].float() * xf.float()[:, None, None, :]).sum(-1)  # [N, k, 2I]
            act = self.act(h[..., :I]) * h[..., I:] * w[..., None]  # [N, k, I]
            routed = (self.w_down[idx].float() * act[..., None]).sum(dim=(1, 2))  # [N, D]
        else:
            # Prefill: every expert on every token as two dense matmuls, weighted by a routing
            # matrix that is zero off the chosen experts (no data-dependent shapes).
            experts = torch.arange(E, device=x.device)
            chosen = ((idx[..., None] == experts) * w[..., None]).sum(1)  # [N, E]
            h = (xf @ self.w_gate_up.view(E * 2 * I, D).t()).view(B * T, E, 2 * I)
            act = self.act(h[..., :I].float()) * h[..., I:].float() * chosen[..., None]  # [N, E, I]
            routed = act.to(x.dtype).view(B * T, E * I) @ self.w_down.view(E * I, D)  # [N, D]
        shared = torch.sigmoid(self.shared_gate(xf)) * self.shared(xf)
        return (routed.to(x.dtype) + shared).view(B, T, D)


# ---------------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, dtype: torch.dtype):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attn = Attention(args, dtype) if args.is_full_attention(layer) else GatedDeltaNet(args, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.moe = MoE(args, dtype)

    def forward(self, x: Tensor, input_pos: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), input_pos)
        return x + self.moe(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.args = args
        dtype = dtype or args.dtype
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(args, i, dtype) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        """tokens [B, T] at positions input_pos [T] -> logits of the last token [B, V], fp32."""
        x = self.tok_embeddings(tokens)  # [B, T, D]
        for layer in self.layers:
            x = layer(x, input_pos)
        return self.output(self.norm(x[:, -1])).float()

    def state_buffer_names(self) -> list[str]:
        """The buffers a session mutates (KV caches, conv and delta-rule states), sorted."""
        return sorted(name for name, _ in self.named_buffers())

    @torch.no_grad()
    def reset_state(self) -> None:
        """Zero every KV cache and recurrent state: the start of a new session."""
        for buf in self.buffers():
            buf.zero_()

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> None:
        """Deterministic random weights (fan-in scaled, so activations and router logits stay O(1))."""
        torch.manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0)
            elif isinstance(module, RMSNorm):
                module.weight.normal_(0.0, 0.1)
            elif isinstance(module, GatedRMSNorm):
                module.weight.normal_(1.0, 0.1)
            elif isinstance(module, GatedDeltaNet):
                module.conv_w.normal_(0.0, module.args.conv_width**-0.5)
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.05, 1.0).log())
                module.dt_bias.normal_(0.0, 0.5)
            elif isinstance(module, MoE):
                module.w_gate_up.normal_(0.0, module.args.dim**-0.5)
                module.w_down.normal_(0.0, module.args.expert_dim**-0.5)
        self.tie_weights()


def build(args: ModelArgs, dtype: Optional[torch.dtype] = None, seed: Optional[int] = 0) -> Transformer:
    """A model on the CPU in eval mode, its weights of `dtype` (default: the args' own): random
    from `seed`, or uninitialised when seed is None (for a checkpoint to fill). Built on the meta
    device first, so no weight is written twice."""
    with torch.device("meta"):
        model = Transformer(args, dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage
    model.reset_state()
    if seed is not None:
        model.init_random(seed)
    return model.eval().requires_grad_(False)

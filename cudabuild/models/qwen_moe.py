"""A Qwen3.5-MoE-style decoder in plain PyTorch, shaped for torch.export and AOTInductor.

Owns the architecture, the table of named sizes and the mapping from Hugging Face tensor names to
this module's parameters. Must not touch files (cudabuild/checkpoint.py reads them) or any export
or compile setting (recipes/qwen_moe.py declares those).

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
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cudabuild.models.checkpoint import CheckpointError, Target


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

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], max_seq_len: int, chunk: int) -> "ModelArgs":
        """Args from a Hugging Face config.json (a Qwen3.5-MoE one; `text_config` when nested)."""
        c = config.get("text_config", config)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}

        def need(key):
            if key not in c:
                raise CheckpointError(f"config.json: missing '{key}' (a Qwen3.5-MoE text config needs it)")
            return c[key]

        args = cls(
            vocab_size=need("vocab_size"),
            dim=need("hidden_size"),
            n_layers=need("num_hidden_layers"),
            n_heads=need("num_attention_heads"),
            n_kv_heads=need("num_key_value_heads"),
            head_dim=c.get("head_dim") or need("hidden_size") // need("num_attention_heads"),
            rope_fraction=c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
            rope_theta=c.get("rope_theta", rope.get("rope_theta", 10_000.0)),
            lin_k_heads=need("linear_num_key_heads"),
            lin_v_heads=need("linear_num_value_heads"),
            lin_k_dim=need("linear_key_head_dim"),
            lin_v_dim=need("linear_value_head_dim"),
            conv_width=need("linear_conv_kernel_dim"),
            n_experts=need("num_experts"),
            top_k=need("num_experts_per_tok"),
            expert_dim=need("moe_intermediate_size"),
            shared_dim=need("shared_expert_intermediate_size"),
            full_attn_every=c.get("full_attention_interval") or _interval(c.get("layer_types")),
            max_seq_len=max_seq_len,
            chunk=chunk,
            norm_eps=c.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
        )
        kinds = c.get("layer_types")
        expected = ["full_attention" if args.is_full_attention(i) else "linear_attention" for i in range(args.n_layers)]
        if kinds is not None and list(kinds) != expected:
            raise CheckpointError(
                f"config.json: layer_types is not one full-attention layer every "
                f"{args.full_attn_every} layers; this model supports only that pattern"
            )
        return args


def _interval(layer_types) -> int:
    """full_attention_interval read off a layer_types list (transformers stores only the list)."""
    if not layer_types or "full_attention" not in layer_types:
        raise CheckpointError("config.json: neither full_attention_interval nor a layer_types list with a full_attention layer")
    return list(layer_types).index("full_attention") + 1


# The named sizes. `tiny` exercises every feature (GQA, partial rotary, grouped delta-rule heads,
# 3 linear + 1 full layers, routed top-2 of 8 plus a gated shared expert) and lowers in seconds;
# `35b-a3b` has the real shapes of Qwen/Qwen3.5-35B-A3B (its config.json's text_config).
SIZES: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=1024, dim=128, n_layers=4,
        n_heads=4, n_kv_heads=2, head_dim=32, rope_fraction=0.25, rope_theta=10_000.0,
        lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, conv_width=4,
        n_experts=8, top_k=2, expert_dim=64, shared_dim=64,
        full_attn_every=2, max_seq_len=128, chunk=8,
    ),
    "35b-a3b": ModelArgs(
        vocab_size=248_320, dim=2048, n_layers=40,
        n_heads=16, n_kv_heads=2, head_dim=256, rope_fraction=0.25, rope_theta=10_000_000.0,
        lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, conv_width=4,
        n_experts=256, top_k=8, expert_dim=512, shared_dim=512,
        full_attn_every=4, max_seq_len=4096, chunk=64,
    ),
}

# Weight dtype of each size when built with random weights.
DTYPES: dict[str, torch.dtype] = {"tiny": torch.float32, "35b-a3b": torch.bfloat16}


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

        R = a.rope_dim
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, R, 2, device=x.device, dtype=torch.float32) / R))
        angles = input_pos.float()[:, None] * inv_freq[None, :]  # [T, R/2]
        q, k = apply_rope(q, angles.cos(), angles.sin()), apply_rope(k, angles.cos(), angles.sin())

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
    def __init__(self, dim: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=dtype)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=dtype)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=dtype)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
        self.shared = FeedForward(D, args.shared_dim, dtype)
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
            act = F.silu(h[..., :I]) * h[..., I:] * w[..., None]  # [N, k, I]
            routed = (self.w_down[idx].float() * act[..., None]).sum(dim=(1, 2))  # [N, D]
        else:
            # Prefill: every expert on every token as two dense matmuls, weighted by a routing
            # matrix that is zero off the chosen experts (no data-dependent shapes).
            experts = torch.arange(E, device=x.device)
            chosen = ((idx[..., None] == experts) * w[..., None]).sum(1)  # [N, E]
            h = (xf @ self.w_gate_up.view(E * 2 * I, D).t()).view(B * T, E, 2 * I)
            act = F.silu(h[..., :I].float()) * h[..., I:].float() * chosen[..., None]  # [N, E, I]
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
    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = args
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


def build(args: ModelArgs, dtype: torch.dtype = torch.float32, seed: Optional[int] = 0) -> Transformer:
    """A model on the CPU in eval mode: random weights from `seed`, or uninitialised when seed is
    None (for a checkpoint to fill). Built on the meta device first, so no weight is written twice."""
    with torch.device("meta"):
        model = Transformer(args, dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage
    model.reset_state()
    if seed is not None:
        model.init_random(seed)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Hugging Face names

# The text tower's prefix in Qwen3.5's multimodal checkpoints; text-only ones use "model.".
HF_PREFIXES = ("model.language_model.", "model.")
# Tensors of a Qwen3.5 checkpoint that are not part of the text decoder.
HF_IGNORED = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp)")

_HF_LAYER = {  # Hugging Face name inside layer i -> this model's name inside layers.i
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn.w_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn.w_z.weight",
    "linear_attn.in_proj_b.weight": "attn.w_b.weight",
    "linear_attn.in_proj_a.weight": "attn.w_a.weight",
    "linear_attn.conv1d.weight": "attn.conv_w",
    "linear_attn.A_log": "attn.A_log",
    "linear_attn.dt_bias": "attn.dt_bias",
    "linear_attn.norm.weight": "attn.norm.weight",
    "linear_attn.out_proj.weight": "attn.wo.weight",
    "mlp.gate.weight": "moe.router.weight",
    "mlp.shared_expert.gate_proj.weight": "moe.shared.w1.weight",
    "mlp.shared_expert.up_proj.weight": "moe.shared.w3.weight",
    "mlp.shared_expert.down_proj.weight": "moe.shared.w2.weight",
    "mlp.shared_expert_gate.weight": "moe.shared_gate.weight",
}
_FULL_ONLY, _LINEAR_ONLY = "self_attn.", "linear_attn."


def hf_targets(args: ModelArgs, prefix: str = "model.language_model.", fused_experts: bool = True) -> dict[str, Target]:
    """Every Hugging Face tensor name of a checkpoint for `args` -> where it goes in Transformer.

    Experts come either fused (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj`
    [E, D, I]) or one tensor per expert (`mlp.experts.{e}.gate_proj.weight` [I, D], ...), each
    copied into its slice of the stacked parameter.
    """
    I = args.expert_dim
    t: dict[str, Target] = {
        prefix + "embed_tokens.weight": Target("tok_embeddings.weight"),
        prefix + "norm.weight": Target("norm.weight"),
    }
    if not args.tie_embeddings:
        t["lm_head.weight"] = Target("output.weight")
    for i in range(args.n_layers):
        skip = _LINEAR_ONLY if args.is_full_attention(i) else _FULL_ONLY
        for hf, ours in _HF_LAYER.items():
            if not hf.startswith(skip):
                t[f"{prefix}layers.{i}.{hf}"] = Target(f"layers.{i}.{ours}")
        hf, ours = f"{prefix}layers.{i}.mlp.experts.", f"layers.{i}.moe."
        if fused_experts:
            t[hf + "gate_up_proj"] = Target(ours + "w_gate_up")
            t[hf + "down_proj"] = Target(ours + "w_down", transpose=True)
        else:
            for e in range(args.n_experts):
                t[f"{hf}{e}.gate_proj.weight"] = Target(ours + "w_gate_up", index=(e, slice(0, I)))
                t[f"{hf}{e}.up_proj.weight"] = Target(ours + "w_gate_up", index=(e, slice(I, 2 * I)))
                t[f"{hf}{e}.down_proj.weight"] = Target(ours + "w_down", index=(e,), transpose=True)
    return t


def hf_layout(names) -> tuple[str, bool]:
    """The (prefix, fused_experts) a checkpoint uses, read off its tensor names."""
    names = list(names)
    prefix = next((p for p in HF_PREFIXES if any(n.startswith(p + "layers.") for n in names)), HF_PREFIXES[0])
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    return prefix, fused


def hf_skipped(args: ModelArgs, prefix: str):
    """A predicate for checkpoint tensors that are deliberately left unread: the vision tower, the
    multi-token-prediction head, and layers beyond a depth cut (`args.n_layers`)."""
    deeper = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")

    def skipped(name: str) -> bool:
        if HF_IGNORED.match(name):
            return True
        m = deeper.match(name)
        return m is not None and int(m.group(1)) >= args.n_layers

    return skipped


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A Hugging Face config.json for `args` (text config only), as `ModelArgs.from_hf` reads it."""
    return {
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.rope_fraction},
        "linear_num_key_heads": args.lin_k_heads,
        "linear_num_value_heads": args.lin_v_heads,
        "linear_key_head_dim": args.lin_k_dim,
        "linear_value_head_dim": args.lin_v_dim,
        "linear_conv_kernel_dim": args.conv_width,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_dim,
        "shared_expert_intermediate_size": args.shared_dim,
        "layer_types": ["full_attention" if args.is_full_attention(i) else "linear_attention" for i in range(args.n_layers)],
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
    }


def from_checkpoint(path, max_seq_len: int, chunk: int, n_layers: int = 0) -> Transformer:
    """A Transformer loaded from a Hugging Face directory (config.json + *.safetensors).

    The weight dtype is the checkpoint's (`dtype`/`torch_dtype` in config.json, else bfloat16);
    `n_layers` > 0 keeps only the first layers.
    """
    from cudabuild.models import checkpoint

    config = checkpoint.read_config(path)
    args = ModelArgs.from_hf(config, max_seq_len=max_seq_len, chunk=chunk).with_layers(n_layers)
    text = config.get("text_config", config)
    dtype_name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, dtype_name or "bfloat16", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{path}/config.json: dtype {dtype_name!r} is not a floating-point torch dtype")
    model = build(args, dtype, seed=None)
    names = checkpoint.tensor_files(path)
    prefix, fused = hf_layout(names)
    checkpoint.load_into(model, path, hf_targets(args, prefix, fused), skip=hf_skipped(args, prefix))
    model.tie_weights()
    return model

"""ExecuTorch's Qwen3.5-MoE without its Triton kernels: a source transformation, and the model it
makes for targets that have none (the CPU form of recipes/qwen_moe.py).

Owns the swap and its plain math, the CPU form's `build` and its weights' projected bytes. Must not
touch: the cuda form (qwen35_moe_cuda.py), where the weights come from (qwen35_moe_weights.py), the
quantizer, files.

The swap and the plain math behind it go as ExecuTorch's own mlx_source_transformations.py and
metal_source_transformations.py swap modules for their backends: each module of ExecuTorch's model
(`executorch.examples.models.qwen3_5_moe.model`) whose forward calls `torch.ops.triton.*` becomes a
subclass of itself whose forward is plain PyTorch. Its names, parameters and buffers stay as they
are, so a state dict, a checkpoint loaded by ExecuTorch's loader and the runner's mutable-buffer
names are the model's own. The swaps:
- FusedMoEExperts (`fused_moe`, `fused_moe_batched_gemm`): decode gathers the k chosen experts'
  weights and reduces them without materialising them; prefill runs every expert as two dense
  matmuls weighted by a routing matrix that is zero off the chosen ones. Unquantized experts
  (`w1_weight`, `w2_weight`) or ExecuTorch's packed int4 (`w1`, `w1_scale`, ...), dequantized.
- SparseMoE: top-k as k rounds of max and mask (no topk kernel), the softmax over the chosen.
- GatedDeltaNet (`fused_deltanet_decode`, `chunk_gated_delta_rule`): decode is one step of the
  recurrence; prefill the chunk-parallel closed form over a static number of chunks with a
  log-depth scan between them (`delta_rule_chunked`): no Python loop over T, so prefill's T stays
  symbolic in torch.export.
- FullAttention (Triton `sdpa`, `sdpa_decode_splitk`): attention over the KV cache as matmuls and
  a softmax, the query heads of a kv head folded into rows (no sdpa, no repeat_interleave).
- W4DequantLinear (`int4_matvec`, `dequant_w4_to_bf16`): the dequantized weight and F.linear.
Every op left is one Inductor generates code for itself (matmul, elementwise, reductions, softmax,
gather, cat, slice_scatter): no custom kernels, no topk/sort, no linalg, no data-dependent shapes.

`build(options)` is the CPU form: ExecuTorch's model given the weights the quantize stage starts
from (cudabuild/models/qwen35_moe_weights.py `weight_parts`: the size's seeded draw, or a Hugging
Face checkpoint through ExecuTorch's lazy subset reader), in the form's dtype and unquantized,
its runtime buffers made as ExecuTorch's exporter makes them, transformed, and with the forward
ExecuTorch binds for backends that sample on the host (`(tokens, input_pos)` -> the last token's
logits).

Shape letters:
  B batch (1)   T new tokens   S max_seq_len   N = B*T tokens   D hidden   H query heads
  G kv heads    Dh head dim    Hv value heads of the delta rule   K key dim   Dv value dim
  E experts     k experts a token   I expert hidden   L delta-rule chunk   n chunks
"""

from __future__ import annotations

import math
from pathlib import Path
import torch
import torch.nn.functional as F
from executorch.examples.models.qwen3_5_moe.model import (
    FullAttention,
    FusedMoEExperts,
    GatedDeltaNet,
    Qwen35MoE,
    SparseMoE,
    W4DequantLinear,
)
from torch import Tensor

from cudabuild.models import qwen35_moe_weights as weights
from cudabuild.models import qwen_moe_checkpoint as checkpoint_fields
from cudabuild.models.qwen35_moe import BF16_BASE, BF16_OF_INT4, BUNDLE_PER_LAYER
from cudabuild.models.qwen35_moe_sizes import depth, kept_layers

# The weights' dtype of each size on the CPU (a checkpoint's is its config.json's).
DTYPES = {"tiny": torch.float32, "35b-a3b": torch.bfloat16}
# The model's per-session state: what a new sequence starts from zero (and the fp32 truth compares).
STATES = ("conv_state", "recurrent_state", "k_cache", "v_cache")


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """ExecuTorch's packed int4 ([.., N, K/2] int8, low nibble first, a scale per group of K) as fp32."""
    p = packed.to(torch.int16) & 0xFF
    values = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).flatten(-2).float() - 8
    return values * scale.float().repeat_interleave(group, dim=-1)


# ---------------------------------------------------------------------------------------------
# The gated delta rule


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


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


class PlainGatedDeltaNet(GatedDeltaNet):
    """ExecuTorch's GatedDeltaNet, its two delta-rule kernels answered in plain PyTorch (fp32).
    `chunk` and `max_seq_len` (set by the transformation) size prefill's chunks."""

    chunk: int
    max_seq_len: int

    def forward(self, x, input_pos):
        B, T, _ = x.size()
        Hk, Hv, K, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        # A call at position 0 starts a new sequence: forget the previous one's state.
        keep = 1.0 - (input_pos[0] == 0).to(self.conv_state.dtype)
        self.conv_state[:B].mul_(keep)
        self.recurrent_state[:B].mul_(keep)

        proj = self.in_proj(x)  # [B, T, C + Hv*Dv + 2*Hv]: [q k v | z | b | a]
        cd, vd = self.conv_dim, self.value_dim
        z = proj[..., cd : cd + vd].reshape(B, T, Hv, Dv)
        b, a = proj[..., cd + vd : cd + vd + Hv], proj[..., cd + vd + Hv :]

        # Causal depthwise conv over [the last W inputs, the new ones], as ExecuTorch writes it.
        conv_input = torch.cat([self.conv_state[:B], proj[..., :cd].transpose(1, 2)], dim=-1)  # [B, C, W+T]
        with torch.no_grad():
            self.conv_state[:B].copy_(conv_input[:, :, -self.conv_kernel_size :])
        w = self.conv1d.weight.squeeze(1).float()  # [C, W]
        T_conv = conv_input.shape[-1] - self.conv_kernel_size + 1
        acc = sum(conv_input[:, :, i : i + T_conv].float() * w[:, i : i + 1] for i in range(self.conv_kernel_size))
        qkv = F.silu(acc[:, :, -T:]).to(conv_input.dtype).transpose(1, 2).float()  # [B, T, C]

        kd = self.key_dim
        rep = self.head_repeat  # value head h reads key head h // rep
        q = l2norm(qkv[..., :kd].reshape(B, T, Hk, K))[:, :, :, None].expand(B, T, Hk, rep, K).reshape(B, T, Hv, K)
        k = l2norm(qkv[..., kd : 2 * kd].reshape(B, T, Hk, K))[:, :, :, None].expand(B, T, Hk, rep, K).reshape(B, T, Hv, K)
        q = q * K**-0.5
        v = qkv[..., 2 * kd :].reshape(B, T, Hv, Dv)
        beta = b.float().sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [B, T, Hv] log decay

        state = self.recurrent_state[:B].float()
        if T == 1:
            o, state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o[:, None]  # [B, 1, Hv, Dv]
        else:
            heads_first = [t.transpose(1, 2) for t in (q, k, v, g, beta)]
            o, state = delta_rule_chunked(*heads_first, state, L=self.chunk, S=self.max_seq_len)
            o = o.transpose(1, 2)  # [B, T, Hv, Dv]
        with torch.no_grad():
            self.recurrent_state[:B].copy_(state.to(self.recurrent_state.dtype))

        out = self.norm(o.to(x.dtype).reshape(-1, Dv), z.reshape(-1, Dv))
        return self.out_proj(out.reshape(B, T, -1))


# ---------------------------------------------------------------------------------------------
# Mixture of experts


def route(scores: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """scores [N, E] -> the softmax over the k best (fp32) [N, k] and their experts [N, k]: what
    topk and softmax give, as k rounds of max and mask (k is static; no sort or topk kernel)."""
    E = scores.shape[-1]
    experts = torch.arange(E, device=scores.device)
    remaining, picked, values = scores.float(), [], []
    for _ in range(top_k):
        best, e = remaining.max(dim=-1)  # [N]
        picked.append(e)
        values.append(best)
        remaining = remaining.masked_fill(experts[None, :] == e[:, None], float("-inf"))
    return torch.softmax(torch.stack(values, dim=-1), dim=-1), torch.stack(picked, dim=-1)


class PlainSparseMoE(SparseMoE):
    """ExecuTorch's SparseMoE with its top-k written without topk."""

    def forward(self, x):
        B, T, C = x.size()
        x_flat = x.view(-1, C)
        expert_weights, expert_indices = route(self.gate(x_flat), self.top_k)
        routed_out = self.experts(x_flat, expert_weights, expert_indices, self.top_k)
        shared_gate = torch.sigmoid(self.shared_expert_gate(x_flat))
        return (routed_out + shared_gate * self.shared_expert(x_flat)).view(B, T, C)


class PlainMoEExperts(FusedMoEExperts):
    """ExecuTorch's fused MoE experts in plain PyTorch, for their weights as loaded ([E, 2I, D]
    `w1_weight`, [E, D, I] `w2_weight`) or as ExecuTorch packs them to int4 (`w1`, `w1_scale`, ...)."""

    def expert_weights(self, dtype) -> tuple[Tensor, Tensor]:
        """(gate|up [E, 2I, D], down [E, D, I]) in `dtype`."""
        if getattr(self, "w1_weight", None) is not None:
            return self.w1_weight.to(dtype), self.w2_weight.to(dtype)
        return (dequantize_int4(self.w1, self.w1_scale, self.group_size).to(dtype),
                dequantize_int4(self.w2, self.w2_scale, self.group_size).to(dtype))

    def forward(self, x, expert_weights, expert_indices, top_k):
        N, D = x.shape
        E, I = self.num_experts, self.intermediate_size
        w1, w2 = self.expert_weights(x.dtype)
        w = expert_weights.float()  # [N, k]
        if N == 1:
            # Decode: read only the k chosen experts. Multiply-and-sum lets Inductor fuse the
            # gather into the reduction instead of copying the experts' weights out first.
            h = (w1[expert_indices].float() * x.float()[:, None, None, :]).sum(-1)  # [N, k, 2I]
            act = F.silu(h[..., :I]) * h[..., I:] * w[..., None]  # [N, k, I]
            routed = (w2[expert_indices].float() * act[..., None, :]).sum(dim=(1, 3))  # [N, D]
        else:
            # Prefill: every expert on every token as two dense matmuls, weighted by a routing
            # matrix that is zero off the chosen experts (no data-dependent shapes).
            chosen = ((expert_indices[..., None] == torch.arange(E, device=x.device)) * w[..., None]).sum(1)  # [N, E]
            h = (x @ w1.reshape(E * 2 * I, D).t()).view(N, E, 2 * I)
            act = F.silu(h[..., :I].float()) * h[..., I:].float() * chosen[..., None]  # [N, E, I]
            routed = act.to(x.dtype).reshape(N, E * I) @ w2.transpose(1, 2).reshape(E * I, D)  # [N, D]
        return routed.to(x.dtype)


class PlainW4DequantLinear(W4DequantLinear):
    """ExecuTorch's dense W4 linear: the weight dequantized, then F.linear, for decode and prefill alike."""

    def forward(self, x):
        weight = dequantize_int4(self.w_packed, self.w_scale, self.group_size).to(x.dtype)  # [N, K]
        return F.linear(x.reshape(-1, self.in_features), weight).reshape(*x.shape[:-1], self.out_features)


# ---------------------------------------------------------------------------------------------
# Attention


class PlainFullAttention(FullAttention):
    """ExecuTorch's FullAttention with its Triton sdpa written as matmuls and a softmax (fp32)."""

    def forward(self, x, input_pos):
        B, T, _ = x.size()
        H, G, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        dtype = x.dtype
        qkv = self.qkv_proj(x)
        q_and_gate = qkv[..., : self.q_dim].view(B, T, H, 2 * Dh)
        q, gate = q_and_gate[..., :Dh], q_and_gate[..., Dh:]
        k = qkv[..., self.q_dim : self.q_dim + self.k_dim].view(B, T, G, Dh)
        v = qkv[..., self.q_dim + self.k_dim :].view(B, T, G, Dh)
        q, k = self.rotary_emb(input_pos, self.q_norm(q), self.k_norm(k))
        q, k, v = q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2), v.transpose(1, 2)  # [B, h, T, Dh]
        keys, values = self.kv_cache.update(input_pos, k, v)  # [B, G, S, Dh]

        # Query heads g*rep .. g*rep+rep-1 share kv head g: fold them into the row dimension.
        rep, S = H // G, keys.shape[2]
        qh = q.reshape(B, G, rep * T, Dh)
        scores = (qh @ keys.transpose(-1, -2)).float() * Dh**-0.5  # [B, G, rep*T, S]
        visible = self.cache_positions[None, :] <= input_pos[:, None]  # [T, S]
        scores = scores.view(B, G, rep, T, S).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(B, G, rep * T, S)
        # Split rows back into (rep, T) before merging (G, rep): one combined view trips export.
        y = (probs @ values).view(B, G, rep, T, Dh).permute(0, 3, 1, 2, 4).reshape(B, T, H * Dh)
        return self.o_proj(y * torch.sigmoid(gate.reshape(B, T, -1)))


# ExecuTorch's modules that call Triton kernels -> their plain subclasses.
PLAIN = {FusedMoEExperts: PlainMoEExperts, SparseMoE: PlainSparseMoE, GatedDeltaNet: PlainGatedDeltaNet,
         FullAttention: PlainFullAttention, W4DequantLinear: PlainW4DequantLinear}


def plain_source_transformations(model: Qwen35MoE, chunk: int) -> dict[str, int]:
    """In place: every module of ExecuTorch's model that calls a Triton kernel becomes its plain
    subclass (same names, parameters and buffers); the delta rule's prefill chunks are `chunk`
    long. Returns how many of each kind were swapped."""
    if chunk < 1:
        raise ValueError(f"the delta rule's chunk must be >= 1, not {chunk}")
    swapped: dict[str, int] = {}
    for module in model.modules():
        plain = PLAIN.get(type(module))
        if plain is None:
            continue
        if getattr(module, "turboquant", False):
            raise ValueError("a TurboQuant KV cache has no plain form here; export without --turboquant")
        module.__class__ = plain
        swapped[plain.__name__] = swapped.get(plain.__name__, 0) + 1
        if isinstance(module, GatedDeltaNet):
            module.max_seq_len = model.config.max_seq_len
            module.chunk = min(chunk, model.config.max_seq_len)
    return swapped


# ---------------------------------------------------------------------------------------------
# The CPU form


def weights_dtype(options) -> torch.dtype:
    """The CPU form's weights' dtype: a checkpoint's config.json's, else the size's."""
    if options.checkpoint:
        config, _ = checkpoint_fields.read_config(Path(options.checkpoint).expanduser())
        return getattr(torch, checkpoint_fields.checked_fields(config)[0].get("dtype", "bfloat16"))
    return DTYPES[options.size]


def weights_bytes(options) -> int:
    """About the bytes of the CPU form's weights (qwen35_moe_cuda.py `weights_bytes` for its bundle):
    a checkpoint's files, or the 35b-a3b size's bf16 weights by layer; tiny's are a few MB (0: not
    projected)."""
    if options.checkpoint:
        folder = Path(options.checkpoint).expanduser().resolve()
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    size = options.size
    layers = kept_layers(options.layers, depth(size))
    return int(BF16_BASE.get(size, 0) + BUNDLE_PER_LAYER.get(size, 0) * BF16_OF_INT4 * layers)


def build(options) -> Qwen35MoE:
    """The CPU form for resolved options (max_seq_len, chunk filled in): ExecuTorch's model, its
    weights those the quantize stage starts from (unquantized, in `weights_dtype`), transformed."""
    from executorch.examples.models.qwen3_5_moe.export import _materialize_buffers, _strip_sampler_from_forward

    config = weights.model_config(options)  # the size's or the checkpoint's, cut to `layers`
    config.max_seq_len = options.max_seq_len
    dtype = weights_dtype(options)
    with torch.device("meta"):
        model = Qwen35MoE(config)
    for prefix, part in weights.weight_parts(options, config, "cpu", dtype):
        if prefix:  # "layers.<i>."
            model.layers[int(prefix.split(".")[1])] = part
        else:
            for name, module in part.items():
                setattr(model, name, module)
    # The runtime buffers as ExecuTorch's exporter makes them (RoPE frequencies, cache positions),
    # then the per-session state zeroed in the weights' dtype.
    _materialize_buffers(model, config)
    for name, buf in list(model.named_buffers()):
        if name.endswith(STATES):
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, torch.zeros(buf.shape, dtype=dtype))
    plain_source_transformations(model, options.chunk)
    _strip_sampler_from_forward(model)  # ExecuTorch's forward for backends that sample on the host
    return model.eval().requires_grad_(False)


def decode_inputs(model) -> tuple:
    return (torch.tensor([[1]], dtype=torch.long), torch.tensor([0], dtype=torch.long))


def prefill_inputs(model) -> tuple:
    # The longest prompt: AOTInductor sizes its hints (and ExecuTorch its buffers) from the example.
    T = model.config.max_seq_len - 1
    return (torch.arange(T, dtype=torch.long)[None, :] % model.config.vocab_size, torch.arange(T, dtype=torch.long))


def prefill_shapes(model):
    T = torch.export.Dim("seq_len", min=2, max=model.config.max_seq_len - 1)
    return ({1: T}, {0: T})

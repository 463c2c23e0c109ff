"""An fp32 truth of ExecuTorch's quantized Qwen3.5-MoE, and how far bf16 alone strays from it: what
verify judges the compiled methods by at the real shapes.

Owns those runs (`truth`, `reference`, `PlainOps`). Must not touch: the build (verify and the
reference stage call `truth`), the quantizer (qwen35_moe_quantize.py), export.

Why: verify compared the compiled program with the exported program run eagerly in bf16. At
`size=35b-a3b` the MoE's routing (top 8 of 256 experts on bf16 scores) is chaotic: any difference
at bf16's last bit moves some token to another expert, and that token's next state by a whole
expert's share. Measured on the H200 (docs/qwen_moe_cuda.md, 2026-12-06): bf16 eager itself
reroutes 1-6 of 14 tokens a call against an fp32 run of the same weights, and its layer-3 KV cache
lies 0.39 (relative) from it; the compiled program lies 0.25 from it. Two right programs are then
far apart, and a state-by-state comparison at bf16's tolerance fails either way. What can be
asked instead: that the compiled program is about as close to the truth as bf16 computations are.

The truth: the quantize stage's weights (the int4 values every run multiplies by), in ExecuTorch's
own model, with every Triton op answered by plain PyTorch in fp32 (`PlainOps`: the fused MoE expert
by expert, the gated delta rule token by token, attention through the math SDPA) and every other
float tensor fp32; a quantized linear multiplies by exactly what its kernel dequantizes (the
linear of an identity: torchao's tile-packed int4 has no dequantize), made when called, so the
model stays as small on the device as the int4 one. The spread of bf16 (`envelope`): the same
plain ops in bf16, as they are and with each router's scores moved by noise below one bf16 ulp
(new near-tie flips each time): the largest distance from the truth of any of them, per state and
per step. The eager exported program's own distance is kept beside it, so a wrong reference shows
as one far outside that spread.
"""

from __future__ import annotations

import importlib
import types
import torch
import torch.nn.functional as F

# The plain forms of ExecuTorch's int4 packing and delta rule, and the model's per-session state
# buffers, are the CPU form's (one definition, whichever form a fix is for).
from cudabuild.models.qwen35_moe_plain import STATES, delta_rule_step, dequantize_int4

# The envelope's runs with noise on the router scores, and the noise (relative; one bf16 ulp is 2^-8).
NOISY_RUNS = 3
ROUTER_NOISE = 2.0 ** -9


def plain_moe(x, w1, w1_scale, w2, w2_scale, weights, ids, top_k, num_experts, group):
    """fused_moe and fused_moe_batched_gemm: per token, the weighted sum over its experts of
    down(silu(gate) * up), computed in fp32 and returned in x's dtype."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w1.shape[1] // 2
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        up_gate = x[rows].float() @ dequantize_int4(w1[e], w1_scale[e], group).t()  # [n, 2I]
        act = F.silu(up_gate[:, :inter]) * up_gate[:, inter:]
        down = act @ dequantize_int4(w2[e], w2_scale[e], group).t()  # [n, D]
        out.index_add_(0, rows, down * weights[rows, slots, None].float())
    return out.to(x.dtype)


def plain_chunk_delta_rule(q, k, v, g, beta, initial_state):
    """chunk_gated_delta_rule: the recurrence token by token in fp32 (q, k come L2-normalised)."""
    scale = q.shape[-1] ** -0.5
    state, outs = initial_state.float(), []
    for t in range(q.shape[1]):
        o, state = delta_rule_step(q[:, t].float() * scale, k[:, t].float(), v[:, t].float(), g[:, t].float(),
                               beta[:, t].float(), state)
        outs.append(o)
    return torch.stack(outs, dim=1).to(v.dtype), state.to(initial_state.dtype)


def plain_deltanet_decode(qkv, alpha, beta_raw, A_log, dt_bias, state):
    """fused_deltanet_decode: split, L2 norm, head repeat (value head h reads key head h // rep),
    gating and one recurrence step, in fp32."""
    B, H, K, V = state.shape
    key_dim = (qkv.shape[1] - H * V) // 2
    rep = H // (key_dim // K)
    x = qkv.float()
    q = F.normalize(x[:, :key_dim].reshape(B, -1, K), dim=-1, eps=1e-6).repeat_interleave(rep, dim=1)
    k = F.normalize(x[:, key_dim:2 * key_dim].reshape(B, -1, K), dim=-1, eps=1e-6).repeat_interleave(rep, dim=1)
    v = x[:, 2 * key_dim:].reshape(B, H, V)
    g = -A_log.float().exp() * F.softplus(alpha.float() + dt_bias.float())
    o, new = delta_rule_step(q * K ** -0.5, k, v, g, beta_raw.float().sigmoid(), state.float())
    return o.to(state.dtype), new.to(state.dtype)


def plain_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.0, enable_gqa=False, **_):
    """sdpa and sdpa_decode_splitk: the math SDPA (grouped heads whenever the head counts differ)."""
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale or None,
                                              enable_gqa=query.shape[1] != key.shape[1])


class PlainOps:
    """ExecuTorch's Triton ops, as the model's forward calls them, answered by the plain functions
    above while inside (the model looks `torch.ops.triton.<op>` and the sdpa module's functions up
    at each call). For eager runs of the module only: an exported program calls the ops' overloads."""

    OPS = {"fused_moe": plain_moe, "fused_moe_batched_gemm": plain_moe,
           "chunk_gated_delta_rule": plain_chunk_delta_rule, "fused_deltanet_decode": plain_deltanet_decode}

    def __enter__(self) -> "PlainOps":
        # The sdpa module itself: the kernels package binds the name `sdpa` to the op.
        self.sdpa_module = importlib.import_module("executorch.backends.cuda.triton.kernels.sdpa")
        self.namespace = torch.ops.triton
        self.saved = {name: self.namespace.__dict__.get(name) for name in self.OPS}
        self.saved_sdpa = (self.sdpa_module.sdpa, self.sdpa_module.sdpa_decode_splitk)
        for name, fn in self.OPS.items():
            setattr(self.namespace, name, fn)
        self.sdpa_module.sdpa = self.sdpa_module.sdpa_decode_splitk = plain_sdpa
        return self

    def __exit__(self, *exc) -> None:
        for name, op in self.saved.items():
            if op is None:
                delattr(self.namespace, name)
            else:
                setattr(self.namespace, name, op)
        self.sdpa_module.sdpa, self.sdpa_module.sdpa_decode_splitk = self.saved_sdpa


def _dequantized_forward(self, x):
    """A quantized linear in the input's precision, multiplying by exactly the weight its kernel
    dequantizes (made for this call only, so the model keeps its int4 size)."""
    eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=x.device)
    with torch.no_grad():
        weight = F.linear(eye, self.weight).t().to(x.dtype)  # [out, in]
    return F.linear(x, weight)


def to_fp32(model) -> None:
    """In place: quantized linears multiply in the input's precision; every other float parameter
    and buffer (norms, embedding, conv, state caches) becomes fp32. The packed experts stay int4."""
    for module in model.modules():
        quantized = isinstance(module, torch.nn.Linear) and type(module.weight) not in (torch.Tensor, torch.nn.Parameter)
        if quantized:
            module.forward = types.MethodType(_dequantized_forward, module)
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if quantized and name == "weight" or t is None or type(t) not in (torch.Tensor, torch.nn.Parameter):
                continue
            if t.dtype.is_floating_point and t.dtype != torch.float32 and not name.endswith("_scale"):
                t.data = t.data.float()


def distance(run: dict, truth: dict) -> dict:
    """{"states": {buffer: max |run - truth|}, "gaps": [per step: how far below the truth's best
    logit the run's own choice lies], "deviations": [per step: max |run's logits - truth's|, where
    the run has logits]} (a run given by tokens chose those; by logits alone, their argmax)."""
    states = {n: float((run["states"][n].float() - want).abs().max()) for n, want in truth["states"].items()
              if n in run["states"] and run["states"][n].shape == want.shape}
    chosen = run.get("tokens") or [int(logits.argmax()) for logits in run["logits"]]
    gaps = [float(t.max() - t[c]) for t, c in zip(truth["logits"], chosen)]
    deviations = [float((got.reshape(-1).float() - want.reshape(-1)).abs().max())
                  for got, want in zip(run.get("logits") or [], truth["logits"])]
    return {"states": states, "gaps": gaps, "deviations": deviations}


def reference(model_loader, options, method_prepare, steps: list, device: str,
              eager: dict | None = None) -> dict:
    """The truth of one method's verify steps and bf16's envelope around it.

    `model_loader()` gives a fresh eager model (bf16, ExecuTorch's) on the host; `method_prepare`
    switches it to the method's path; `eager` is the eager exported program's own run (tokens and
    states). Returns {"truth": {"logits", "states"}, "envelope": {"states": {buffer: the largest
    distance of the plain bf16 runs}, "gaps" and "deviations": [per step, the largest]}, "runs": their count,
    "eager": the eager program's own distance (`distance`), so verify can tell a wrong reference}.
    The runs go layer by layer (`runs_layer_by_layer`): `device` holds one part of the model at a time."""
    model = model_loader()
    method_prepare(model, options)
    with PlainOps():
        *runs, truth = runs_layer_by_layer(model, steps, device, noise_seeds=range(NOISY_RUNS))
    del model
    distances = [distance(run, truth) for run in runs]
    envelope = {"states": {n: max(d["states"].get(n, 0.0) for d in distances) for n in truth["states"]},
                "gaps": [max(d["gaps"][i] for d in distances) for i in range(len(steps))],
                "deviations": [max(d["deviations"][i] for d in distances) for i in range(len(steps))]}
    return {"truth": truth, "envelope": envelope, "runs": len(runs),
            **({"eager": distance(eager, truth)} if eager is not None else {})}


def runs_layer_by_layer(model, steps: list, device: str, noise_seeds=()) -> list[dict]:
    """verify's steps from position 0, state kept between them: {"logits": [the last token's logits
    per step], "states": {buffer: value after the last step}}, for each run `reference` makes: the plain bf16 model, the same with its router scores moved by
    noise (one run per seed in `noise_seeds`), and last the fp32 truth (`to_fp32`).

    Layer by layer, not step by step: each part of the model (the embedding, each decoder block,
    the final norm with the head) is put on `device` once, runs every run's steps, and is let go
    before the next part comes, so the device holds one layer's weights and the runs'
    activations, never the model. Why: at 40 layers of 35b-a3b the model is 19 GiB of int4
    experts and bf16 embeddings, and the reference stage, which held it whole on the device,
    peaked at 23.06 GiB (H100, 2026-12-06). Each run's own state is zeroed before it starts, so
    runs do not see each other's; a noisy run's noise is drawn per (seed, layer)."""
    seeds: list = [None, *noise_seeds]
    inputs = [(tokens.to(device), positions.to(device)) for tokens, positions, *_ in steps]
    with torch.no_grad():
        with _on(device, model.embed_tokens):
            xs = [[model.embed_tokens(tokens) for tokens, _ in inputs] for _ in seeds]
            to_fp32(model.embed_tokens)
            xs.append([model.embed_tokens(tokens) for tokens, _ in inputs])
        states: list[dict] = [{} for _ in xs]
        for index, layer in enumerate(model.layers):
            prefix = f"layers.{index}."
            with _on(device, layer, rope=model.config):
                for run, seed in enumerate(seeds):
                    _run_layer(layer, xs[run], inputs, states[run], prefix, seed, index)
                to_fp32(layer)
                _run_layer(layer, xs[-1], inputs, states[-1], prefix, None, index)
        with _on(device, model.norm, model.lm_head):
            logits = [[model.lm_head(model.norm(x))[0, -1].float().cpu() for x in run] for run in xs[:-1]]
            to_fp32(model.norm)
            to_fp32(model.lm_head)
            logits.append([model.lm_head(model.norm(x))[0, -1].float().cpu() for x in xs[-1]])
    return [{"logits": run_logits, "states": run_states} for run_logits, run_states in zip(logits, states)]


def _run_layer(layer, xs: list, inputs: list, states: dict, prefix: str, seed: int | None, index: int) -> None:
    """One run's steps through one decoder layer, from a zero state: `xs` (the run's activations,
    one per step) replaced by the layer's outputs, its state after the last step put in `states`."""
    for name, buf in layer.named_buffers():
        if name.endswith(STATES):
            buf.zero_()
    hook = None
    if seed is not None:
        device = xs[0].device
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)

        def moved(module, args, out):
            noise = torch.randn(out.shape, device=out.device, generator=generator)
            return (out.float() * (1 + ROUTER_NOISE * noise)).to(out.dtype)

        hook = layer.mlp.gate.register_forward_hook(moved)
    try:
        for step, (_, positions) in enumerate(inputs):
            xs[step] = layer(xs[step], positions)
    finally:
        if hook is not None:
            hook.remove()
    states.update({prefix + n: b.detach().float().cpu().clone() for n, b in layer.named_buffers() if n.endswith(STATES)})


class _on:
    """Within the block, the modules' parameters and buffers on `device` (each tensor moved as
    ExecuTorch's inference helper moves them, tensor subclasses included, and a rotary embedding's
    inv_freq computed there as it computes it, where `rope` gives the model's config); on leaving,
    the host tensors are theirs again and the device copies are let go (anything the block did to
    them with them)."""

    def __init__(self, device: str, *modules, rope=None):
        self.device, self.modules, self.rope, self.saved = device, modules, rope, []

    def __enter__(self):
        for top in self.modules:
            for owner in top.modules():
                for name, p in list(owner.named_parameters(recurse=False)):
                    self.saved.append((owner, name, p, True))
                    setattr(owner, name, torch.nn.Parameter(p.data.to(self.device), requires_grad=False))
                for name, b in list(owner.named_buffers(recurse=False)):
                    if b is not None:
                        self.saved.append((owner, name, b, False))
                        owner.register_buffer(name, b.to(self.device), persistent=name not in owner._non_persistent_buffers_set)
        if self.rope is not None and self.device != "cpu":
            for top in self.modules:
                for owner in top.modules():
                    rope = getattr(owner, "rotary_emb", None)
                    if rope is not None:
                        dims = torch.arange(0, rope.rotary_dim, 2, dtype=torch.float32) / rope.rotary_dim
                        rope.inv_freq = (1.0 / (self.rope.rope_theta ** dims)).to(self.device)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value, is_parameter in reversed(self.saved):
            if is_parameter:
                setattr(owner, name, value)
            else:
                owner.register_buffer(name, value, persistent=name not in owner._non_persistent_buffers_set)
        self.saved = []


def truth(options, folder, prepare, steps: list, device: str, eager: dict | None = None) -> dict:
    """The recipe's `Quantize.truth` (cudabuild.recipe): `reference` on the model the quantize
    stage's bundle in `folder` holds, loaded as the export stage loads it, on the host; each part
    goes to `device` in turn (`runs_layer_by_layer`)."""
    from cudabuild.models import qwen35_moe_cuda

    return reference(lambda: qwen35_moe_cuda.load(options, folder).eval(), options, prepare, steps, device, eager)

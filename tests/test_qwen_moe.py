"""Tests for cudabuild/models/qwen35_moe_plain.py and the CPU form of recipes/qwen_moe.py.

The CPU form is ExecuTorch's Qwen3.5-MoE with its Triton-calling modules swapped for plain PyTorch.
It is checked three ways: against a sequential reference written here from the architecture's
definition (token by token, recurrence step by step, float64), against ExecuTorch's own forward
with its Triton ops answered by the fp32 truth's plain ops (cudabuild/models/qwen35_moe_fp32.py:
the same weights through the untransformed modules), and exported with the recipe's methods, run,
and compiled with AOTInductor on the CPU.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cudabuild import registry
from cudabuild.errors import InvalidOption
from cudabuild.models import qwen35_moe_plain as plain
from cudabuild.models import qwen35_moe_weights as weights

ROOT = Path(__file__).resolve().parents[1]
SEQ = 37  # spans five delta-rule chunks of the tiny size (chunk 8)
CPU_DEFAULTS = registry.load_recipe(ROOT, "qwen_moe").defaults("cpu")  # size=tiny, every layer


# ---------------------------------------------------------------------------------------------
# A sequential reference: one token at a time, float64, no shared code with the model


def _norm(x, w, eps, offset=True):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if offset else y * w


def _rope(x, pos, c):  # x [T, h, Dh]; the rotate-half form of Hugging Face, on the first R dims
    R = int(c.head_dim * c.partial_rotary_factor)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = pos.double()[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    xr = x[..., :R]
    half = torch.cat([-xr[..., R // 2 :], xr[..., : R // 2]], -1)
    return torch.cat([xr * cos + half * sin, x[..., R:]], -1)


def W(linear):
    return linear.weight.double()


def _attention(m, x, c):
    T, H, G, Dh = x.shape[0], c.num_attention_heads, c.num_kv_heads, c.head_dim
    q_dim, k_dim = H * Dh * 2, G * Dh
    qkv = x @ W(m.qkv_proj).T
    q, gate = qkv[:, :q_dim].view(T, H, 2 * Dh).chunk(2, dim=-1)
    k = qkv[:, q_dim : q_dim + k_dim].view(T, G, Dh)
    v = qkv[:, q_dim + k_dim :].view(T, G, Dh)
    pos = torch.arange(T)
    q = _rope(_norm(q, m.q_norm.weight.double(), c.rms_norm_eps), pos, c)
    k = _rope(_norm(k, m.k_norm.weight.double(), c.rms_norm_eps), pos, c)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    out = torch.zeros(T, H, Dh, dtype=torch.float64)
    for t in range(T):
        p = torch.softmax(torch.einsum("hd,shd->hs", q[t], k[: t + 1]) / math.sqrt(Dh), dim=-1)
        out[t] = torch.einsum("hs,shd->hd", p, v[: t + 1])
    return (out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))) @ W(m.o_proj).T


def _deltanet(m, x, c):
    T = x.shape[0]
    Hk, Hv, K, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    C, Wd = 2 * Hk * K + Hv * Dv, c.linear_conv_kernel_dim
    proj = x @ W(m.in_proj).T  # [T, C + Hv*Dv + 2*Hv]
    mixed, z, b, a = proj.split([C, Hv * Dv, Hv, Hv], dim=-1)
    mixed = F.silu(F.conv1d(mixed.T[None], m.conv1d.weight.double(), padding=Wd - 1, groups=C)[0, :, :T].T)
    q, k, v = mixed.split([Hk * K, Hk * K, Hv * Dv], dim=-1)
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = l2(q.view(T, Hk, K)).repeat_interleave(Hv // Hk, dim=1) / math.sqrt(K)
    k = l2(k.view(T, Hk, K)).repeat_interleave(Hv // Hk, dim=1)
    v = v.view(T, Hv, Dv)
    beta = torch.sigmoid(b)
    g = -m.A_log.double().exp() * F.softplus(a + m.dt_bias.double())
    S = torch.zeros(Hv, K, Dv, dtype=torch.float64)
    out = []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], S))
    o = _norm(torch.stack(out), m.norm.weight.double(), c.rms_norm_eps, offset=False) * F.silu(z.view(T, Hv, Dv))
    return o.reshape(T, -1) @ W(m.out_proj).T


def _moe(m, x, c):
    I = c.moe_intermediate_size
    scores, idx = (x @ W(m.gate).T).topk(c.num_experts_per_tok, dim=-1)
    w = torch.softmax(scores, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(c.num_experts_per_tok):
            e = idx[t, j]
            gu = m.experts.w1_weight[e].double() @ x[t]
            out[t] += w[t, j] * (m.experts.w2_weight[e].double() @ (F.silu(gu[:I]) * gu[I:]))
    s = m.shared_expert
    gu = x @ W(s.gate_up_proj).T
    shared = (F.silu(gu[:, : c.shared_expert_intermediate_size]) * gu[:, c.shared_expert_intermediate_size :]) @ W(s.down_proj).T
    return out + torch.sigmoid(x @ W(m.shared_expert_gate).T) * shared


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> logits [T, V] of the whole sequence, from scratch."""
    c = model.config
    x = model.embed_tokens.weight.double()[tokens]
    for layer in model.layers:
        mix = _attention if layer.layer_type == "full_attention" else _deltanet
        x = x + mix(layer.attn, _norm(x, layer.ln_1.weight.double(), c.rms_norm_eps), c)
        x = x + _moe(layer.mlp, _norm(x, layer.ln_2.weight.double(), c.rms_norm_eps), c)
    return _norm(x, model.norm.weight.double(), c.rms_norm_eps) @ W(model.lm_head).T


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def recipe():
    return registry.load_recipe(ROOT, "qwen_moe")


def options(recipe, **changes):
    return recipe.resolve(recipe.defaults("cpu").replace(**changes))


@pytest.fixture(scope="module")
def model(recipe):
    return recipe.build(options(recipe))


@pytest.fixture(scope="module")
def tokens(model):
    return torch.randint(0, model.config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def expected(model, tokens):
    with torch.no_grad():
        return reference_logits(model, tokens).float()  # [SEQ, V]


def close(got, want, tol=2e-4):
    scale = max(1.0, want.abs().max().item())
    return (got - want).abs().max().item() <= tol * scale


def run(model, tokens, start):
    with torch.no_grad():
        return model(tokens[None], torch.arange(start, start + tokens.shape[0]))[0]


# ---------------------------------------------------------------------------------------------
# The transformation


def test_every_module_that_calls_a_triton_kernel_is_swapped_and_nothing_else(model):
    from executorch.examples.models.qwen3_5_moe.model import GatedDeltaNet

    kinds = [type(layer.attn) for layer in model.layers]
    assert kinds == [plain.PlainGatedDeltaNet, plain.PlainFullAttention] * 2
    assert all(type(layer.mlp) is plain.PlainSparseMoE and type(layer.mlp.experts) is plain.PlainMoEExperts
               for layer in model.layers)
    assert isinstance(model.layers[0].attn, GatedDeltaNet)  # ExecuTorch's own checks still know it
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (8, 2)


def test_the_transformation_keeps_names_weights_and_buffers():
    """ExecuTorch's model before and after: the same state dict, the very same tensors."""
    config = weights.model_config(CPU_DEFAULTS)
    theirs = weights.seeded_model(config, 42)
    before = {name: t.data_ptr() for name, t in theirs.state_dict(keep_vars=True).items()}
    swapped = plain.plain_source_transformations(theirs, chunk=8)
    assert {name: t.data_ptr() for name, t in theirs.state_dict(keep_vars=True).items()} == before
    assert swapped == {"PlainGatedDeltaNet": 2, "PlainFullAttention": 2, "PlainSparseMoE": 4, "PlainMoEExperts": 4}


def test_the_cpu_form_computes_what_executorch_computes_with_its_triton_ops_answered_plainly(tokens):
    """The other half of the one-model check that runs here: ExecuTorch's untransformed model, its
    experts packed to int4 as its exporter packs them, its Triton ops answered by the fp32 truth's
    plain ops (qwen35_moe_fp32.PlainOps), against a transformed copy of the same module."""
    from executorch.examples.models.qwen3_5_moe.export import _materialize_buffers, _quantize_experts_int4

    from cudabuild.backend import custom_ops
    from cudabuild.models import qwen35_moe_fp32 as fp32

    custom_ops.register("cuda")  # the ops' names, for PlainOps to stand in for
    config = weights.model_config(CPU_DEFAULTS)
    theirs = weights.seeded_model(config, 42)
    _quantize_experts_int4(theirs, config, 32)
    _materialize_buffers(theirs, config)
    theirs = theirs.float()
    ours = copy.deepcopy(theirs)
    plain.plain_source_transformations(ours, chunk=8)
    prompt = tokens[None, :20] % config.vocab_size
    with torch.no_grad(), fp32.PlainOps():
        want, got = theirs(prompt, torch.arange(20))[0, -1], ours(prompt, torch.arange(20))[0, -1]
        assert close(got, want, tol=1e-5)
        nxt = prompt[:, :1]
        want, got = theirs(nxt, torch.tensor([20]))[0, -1], ours(nxt, torch.tensor([20]))[0, -1]
        assert close(got, want, tol=1e-5)


# ---------------------------------------------------------------------------------------------
# The model against the reference


def test_decode_step_by_step_matches_reference(model, tokens, expected):
    for t in range(SEQ):
        assert close(run(model, tokens[t : t + 1], t), expected[t]), f"token {t}"


@pytest.mark.parametrize("T", [2, 8, 9, SEQ])
def test_prefill_matches_reference(model, tokens, expected, T):
    assert close(run(model, tokens[:T], 0), expected[T - 1])


def test_prefill_then_decode_continues_the_sequence(model, tokens, expected):
    run(model, tokens[:20], 0)
    for t in range(20, SEQ):
        assert close(run(model, tokens[t : t + 1], t), expected[t]), f"token {t}"


def test_second_prefill_continues_from_the_state_of_the_first(model, tokens, expected):
    run(model, tokens[:13], 0)
    assert close(run(model, tokens[13:], 13), expected[-1])


def test_a_call_at_position_zero_starts_a_new_sequence(model, tokens, expected):
    run(model, tokens.flip(0), 0)
    assert close(run(model, tokens[:9], 0), expected[8])


def test_chunked_delta_rule_matches_the_recurrence():
    gen = torch.Generator().manual_seed(2)
    B, H, K, Dv, L, S = 1, 3, 16, 8, 8, 128
    for T in (2, 7, 8, 16, 61, S - 1):
        q, k = torch.randn(B, H, T, K, generator=gen), F.normalize(torch.randn(B, H, T, K, generator=gen), dim=-1)
        v = torch.randn(B, H, T, Dv, generator=gen)
        g, beta = -0.2 * torch.rand(B, H, T, generator=gen), torch.rand(B, H, T, generator=gen)
        state = torch.randn(B, H, K, Dv, generator=gen)
        out, final = plain.delta_rule_chunked(q, k, v, g, beta, state, L=L, S=S)
        s, steps = state, []
        for t in range(T):
            o, s = plain.delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], s)
            steps.append(o)
        assert torch.allclose(out, torch.stack(steps, dim=2), atol=1e-4), f"T={T}"
        assert torch.allclose(final, s, atol=1e-4), f"T={T}"


def test_routing_without_topk_is_topk_then_softmax():
    scores = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    weights, experts = plain.route(scores, 2)
    values, indices = scores.topk(2, dim=-1)
    assert torch.equal(experts, indices) and torch.allclose(weights, values.softmax(-1))


def test_state_buffers_start_zero_and_update_in_place(recipe):
    model = recipe.build(options(recipe, layers=2))
    names = json.loads(recipe.constant_methods(model)["get_mutable_buffer_metadata"])["mutable_buffers"]
    assert names == ["layers.0.attn.conv_state", "layers.0.attn.recurrent_state",
                     "layers.1.attn.kv_cache.k_cache", "layers.1.attn.kv_cache.v_cache"]
    buffers = dict(model.named_buffers())
    assert all(not buffers[n].any() for n in names)
    cache = buffers["layers.1.attn.kv_cache.k_cache"]
    pointer = cache.data_ptr()
    run(model, torch.tensor([3, 4, 5]), 0)
    assert cache.data_ptr() == pointer and cache[:, :, :3].any() and not cache[:, :, 3:].any()


# ---------------------------------------------------------------------------------------------
# The recipe


def test_recipe_resolves_max_seq_len_and_chunk_from_the_size(recipe):
    base = recipe.defaults("cpu")
    assert recipe.resolve(base) == {**base, "max_seq_len": 64, "chunk": 8}
    assert recipe.resolve(base.replace(size="35b-a3b")) == {**base, "size": "35b-a3b", "max_seq_len": 4096, "chunk": 64}
    assert recipe.resolve(base.replace(max_seq_len=32, chunk=16)) == {**base, "max_seq_len": 32, "chunk": 16}
    model = recipe.build(recipe.resolve(base.replace(max_seq_len=32, chunk=16)))
    assert model.config.max_seq_len == 32 and model.layers[0].attn.chunk == 16
    assert model.layers[1].attn.kv_cache.k_cache.shape[2] == 32
    with pytest.raises(InvalidOption, match=r"^qwen_moe option max_seq_len=2: expected an integer >= 4"):
        recipe.resolve(base.replace(max_seq_len=2))


def test_recipe_cuts_depth_and_refuses_more_layers_than_the_size_has(recipe):
    assert len(recipe.build(options(recipe, layers=1)).layers) == 1
    with pytest.raises(InvalidOption, match="qwen_moe option layers=9: the size tiny has 4"):
        options(recipe, layers=9)


def test_the_cpu_weights_are_the_cuda_forms_before_quantization(recipe, model):
    """One draw for both forms: the stock --tiny-test weights (bf16 values), held here in fp32."""
    theirs = weights.seeded_model(weights.model_config(CPU_DEFAULTS), 42)
    ours = dict(model.named_parameters())
    for name, t in theirs.named_parameters():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], t.float()), name


def test_constant_methods_are_runner_metadata(recipe, model):
    meta = recipe.constant_methods(model)
    assert meta["get_max_seq_len"] == 64 and meta["get_vocab_size"] == 256 and meta["get_n_layers"] == 4
    assert meta["use_kv_cache"] is True
    assert all(isinstance(v, (bool, int, str)) for v in meta.values())


def test_35b_a3b_has_the_hugging_face_shapes():
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoE

    config = weights.model_config(CPU_DEFAULTS.replace(size="35b-a3b", layers=4))
    with torch.device("meta"):
        model = Qwen35MoE(config)
    p = dict(model.named_parameters())
    # From Qwen/Qwen3.5-35B-A3B's config.json: hidden 2048, 16 q / 2 kv heads of 256, linear heads
    # 16 key / 32 value of 128, conv 4, 256 experts of 512, shared expert 512, vocab 248320.
    assert p["embed_tokens.weight"].shape == (248_320, 2048)
    assert p["layers.0.attn.in_proj.weight"].shape == (2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32, 2048)
    assert p["layers.0.attn.conv1d.weight"].shape == (8192, 1, 4)
    assert p["layers.0.attn.A_log"].shape == (32,)
    assert p["layers.3.attn.qkv_proj.weight"].shape == (16 * 256 * 2 + 2 * 2 * 256, 2048)
    assert p["layers.3.attn.o_proj.weight"].shape == (2048, 16 * 256)
    assert p["layers.0.mlp.experts.w1_weight"].shape == (256, 2 * 512, 2048)
    assert p["layers.0.mlp.experts.w2_weight"].shape == (256, 2048, 512)
    assert p["layers.0.mlp.gate.weight"].shape == (256, 2048)
    assert p["layers.0.mlp.shared_expert.gate_up_proj.weight"].shape == (2 * 512, 2048)
    assert [layer.layer_type for layer in model.layers] == ["linear_attention"] * 3 + ["full_attention"]


# ---------------------------------------------------------------------------------------------
# torch.export and AOTInductor


@pytest.fixture(scope="module")
def exported(recipe, model):
    programs = {}
    with torch.no_grad():
        for method in recipe.methods:
            shapes = method.dynamic_shapes(model) if method.dynamic_shapes else None
            programs[method.name] = torch.export.export(model, method.inputs(model), dynamic_shapes=shapes, strict=False)
    return programs


def test_export_keeps_the_kv_caches_zero(recipe):
    # ExecuTorch's low-memory CUDA path frees buffers named *kv_cache* only if they are all zero.
    model = recipe.build(options(recipe, layers=2))
    method = recipe.methods[0]
    ep = torch.export.export(model, method.inputs(model), strict=False)
    caches = {n: t for n, t in {**ep.state_dict, **ep.constants}.items() if "kv_cache" in n}
    assert sorted(caches) == ["layers.1.attn.kv_cache.k_cache", "layers.1.attn.kv_cache.v_cache"]
    assert not any(t.any() for t in caches.values())
    assert not any(b.any() for n, b in model.named_buffers() if n.endswith(plain.STATES))


@pytest.fixture(scope="module")
def decomposed(exported):
    """The core-ATen programs that lowering sees (functionalized: mutations become outputs)."""
    return {name: ep.run_decompositions() for name, ep in exported.items()}


def test_lowered_programs_mutate_every_state_buffer(decomposed, recipe, model):
    names = json.loads(recipe.constant_methods(model)["get_mutable_buffer_metadata"])["mutable_buffers"]
    for ep in decomposed.values():
        assert sorted(ep.graph_signature.buffers_to_mutate.values()) == names


def test_lowered_graphs_use_no_forbidden_ops(decomposed):
    forbidden = ("topk", "sort", "nonzero", "linalg", "scaled_dot_product", "cumsum", "repeat_interleave", "triton")
    for name, ep in decomposed.items():
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert not [op for op in ops if any(f in op for f in forbidden)], name


def test_exported_decode_matches_eager(exported, model, tokens):
    got = exported["decode"].module()(tokens[None, :1], torch.tensor([0]))
    assert close(got[0], run(model, tokens[:1], 0), tol=1e-5)


def test_exported_prefill_is_one_graph_for_every_length(exported, model, tokens):
    ep = exported["prefill"]
    (bounds,) = ep.range_constraints.values()
    assert (bounds.lower, bounds.upper) == (2, model.config.max_seq_len - 1)
    for T in (5, SEQ):
        got = ep.module()(tokens[None, :T], torch.arange(T))
        assert close(got[0], run(model, tokens[:T], 0), tol=1e-5), f"T={T}"


@pytest.mark.slow
def test_aoti_compiles_both_methods_on_cpu_with_only_matmul_fallbacks(built_qwen_cpu):
    """The run's one qwen_moe CPU build (its compile stage is AOTInductor's, its verify the exported
    program's eager run, which the tests above hold to the reference): on CPU the matmuls are calls
    into aten, everything else is generated code, and both methods' compiled code verifies."""
    project = built_qwen_cpu
    for name in ("decode", "prefill"):
        stamp = json.loads((project.root / "build/qwen_moe/cpu/.stamps" / f"compile.{name}.json").read_text())
        seen = set(stamp["value"]["fallback_kernels"])
        assert seen and seen <= {"aoti_torch_cpu_mm_out", "aoti_torch_cpu_bmm_out", "aoti_torch_cpu_addmm_out"}, (name, seen)
    verify = project.manifest("qwen_moe", "cpu")["verify"]
    assert sorted(verify) == ["decode", "prefill"] and all(v["passed"] for v in verify.values()), verify

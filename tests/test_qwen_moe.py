"""Tests for cudabuild/models/qwen_moe.py and recipes/qwen_moe.py.

The model is checked against a sequential reference written here from the architecture's
definition (token by token, recurrence step by step, float64), then exported with the recipe's
methods, run, and compiled with AOTInductor on the CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cudabuild import registry
from cudabuild.errors import InvalidOption
from cudabuild.models import qwen_moe as qm
from cudabuild.models import qwen_moe_hf as qhf

ROOT = Path(__file__).resolve().parents[1]
SEQ = 37  # spans five delta-rule chunks of the tiny size (chunk 8)


# ---------------------------------------------------------------------------------------------
# A sequential reference: one token at a time, float64, no shared code with the model


def _norm(x, w, eps, offset=True):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if offset else y * w


def _inv_freq(a):
    """Hugging Face's _compute_{default,linear,yarn}_parameters, in float64: (inv_freq, cos/sin factor)."""
    R, base = a.rope_dim, a.rope_theta
    pos_freqs = base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    if a.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if a.rope_type == "linear":
        return 1.0 / pos_freqs / a.rope_factor, 1.0
    assert a.rope_type == "yarn"
    def find_correction_dim(num_rotations):
        return (R * math.log(a.rope_original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = find_correction_dim(a.rope_beta_fast), find_correction_dim(a.rope_beta_slow)
    if a.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001
    extrapolation_factor = 1 - ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    interpolation, extrapolation = 1.0 / (a.rope_factor * pos_freqs), 1.0 / pos_freqs
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, a.rope_attention_factor


def _rope(x, pos, a):  # x [T, h, Dh]; the rotate-half form of Hugging Face
    R = a.rope_dim
    inv, factor = _inv_freq(a)
    ang = pos.double()[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    cos, sin = cos * factor, sin * factor
    xr = x[..., :R]
    half = torch.cat([-xr[..., R // 2 :], xr[..., : R // 2]], -1)
    return torch.cat([xr * cos + half * sin, x[..., R:]], -1)


def _attention(m, x, a):
    T, H, G, Dh = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
    W = lambda lin: lin.weight.double()  # noqa: E731
    q, gate = (x @ W(m.wq).T).view(T, H, 2 * Dh).chunk(2, dim=-1)
    k = (x @ W(m.wk).T).view(T, G, Dh)
    v = (x @ W(m.wv).T).view(T, G, Dh)
    pos = torch.arange(T)
    q = _rope(_norm(q, m.q_norm.weight.double(), a.norm_eps), pos, a)
    k = _rope(_norm(k, m.k_norm.weight.double(), a.norm_eps), pos, a)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    out = torch.zeros(T, H, Dh, dtype=torch.float64)
    for t in range(T):
        p = torch.softmax(torch.einsum("hd,shd->hs", q[t], k[: t + 1]) / math.sqrt(Dh), dim=-1)
        out[t] = torch.einsum("hs,shd->hd", p, v[: t + 1])
    return (out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))) @ W(m.wo).T


def _deltanet(m, x, a):
    T, C, Wd = x.shape[0], a.conv_dim, a.conv_width
    Hk, Hv, K, Dv = a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
    W = lambda lin: lin.weight.double()  # noqa: E731
    mixed = x @ W(m.w_qkv).T  # [T, C]
    mixed = F.silu(F.conv1d(mixed.T[None], m.conv_w.double(), padding=Wd - 1, groups=C)[0, :, :T].T)
    q, k, v = mixed.split([Hk * K, Hk * K, Hv * Dv], dim=-1)
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = l2(q.view(T, Hk, K)).repeat_interleave(Hv // Hk, dim=1) / math.sqrt(K)
    k = l2(k.view(T, Hk, K)).repeat_interleave(Hv // Hk, dim=1)
    v = v.view(T, Hv, Dv)
    beta = torch.sigmoid(x @ W(m.w_b).T)
    g = -m.A_log.double().exp() * F.softplus(x @ W(m.w_a).T + m.dt_bias.double())
    S = torch.zeros(Hv, K, Dv, dtype=torch.float64)
    out = []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], S))
    z = (x @ W(m.w_z).T).view(T, Hv, Dv)
    o = _norm(torch.stack(out), m.norm.weight.double(), a.norm_eps, offset=False) * F.silu(z)
    return o.reshape(T, -1) @ W(m.wo).T


_ACT = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _moe(m, x, a):
    I, act = a.expert_dim, _ACT[a.hidden_act]
    W = lambda lin: lin.weight.double()  # noqa: E731
    w, idx = torch.softmax(x @ W(m.router).T, dim=-1).topk(a.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(a.top_k):
            e = idx[t, j]
            gu = m.w_gate_up[e].double() @ x[t]
            out[t] += w[t, j] * ((act(gu[:I]) * gu[I:]) @ m.w_down[e].double())
    s = m.shared
    shared = (act(x @ W(s.w1).T) * (x @ W(s.w3).T)) @ W(s.w2).T
    return out + torch.sigmoid(x @ W(m.shared_gate).T) * shared


def reference_logits(model: qm.Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> logits [T, V] of the whole sequence, from scratch."""
    a = model.args
    x = model.tok_embeddings.weight.double()[tokens]
    for layer in model.layers:
        mix = _attention if isinstance(layer.attn, qm.Attention) else _deltanet
        x = x + mix(layer.attn, _norm(x, layer.attn_norm.weight.double(), a.norm_eps), a)
        x = x + _moe(layer.moe, _norm(x, layer.ffn_norm.weight.double(), a.norm_eps), a)
    return _norm(x, model.norm.weight.double(), a.norm_eps) @ model.output.weight.double().T


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def recipe():
    return registry.load_recipe(ROOT, "qwen_moe")


@pytest.fixture(scope="module")
def model(recipe):
    return recipe.build(recipe.defaults("cpu"))


@pytest.fixture(scope="module")
def tokens(model):
    return torch.randint(0, model.args.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(1))


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
# The model against the reference


def test_tiny_has_both_layer_kinds_and_routed_experts(model):
    kinds = [type(layer.attn) for layer in model.layers]
    assert qm.Attention in kinds and qm.GatedDeltaNet in kinds
    assert model.args.n_experts == 8 and model.args.top_k == 2


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


@pytest.mark.parametrize("changes", [
    pytest.param(dict(rope_type="linear", rope_factor=4.0), id="rope-linear"),
    pytest.param(dict(rope_type="yarn", rope_factor=4.0, rope_original_max=32, rope_attention_factor=1.1386), id="rope-yarn"),
    pytest.param(dict(hidden_act="gelu_pytorch_tanh"), id="gelu-tanh"),
])
def test_config_variants_match_the_reference(changes, tokens):
    from dataclasses import replace

    model = qm.build(replace(qm.SIZES["tiny"], **changes), seed=0)
    plain = qm.build(qm.SIZES["tiny"], seed=0)
    with torch.no_grad():
        want = reference_logits(model, tokens).float()
    assert close(run(model, tokens, 0), want[-1])
    for t in range(3):
        assert close(run(model, tokens[t : t + 1], t), want[t]), f"token {t}"
    assert not close(run(plain, tokens, 0), want[-1])  # the variant changes the numbers


def test_chunked_delta_rule_matches_the_recurrence():
    gen = torch.Generator().manual_seed(2)
    B, H, K, Dv, L, S = 1, 3, 16, 8, 8, 128
    for T in (2, 7, 8, 16, 61, S - 1):
        q, k = torch.randn(B, H, T, K, generator=gen), F.normalize(torch.randn(B, H, T, K, generator=gen), dim=-1)
        v = torch.randn(B, H, T, Dv, generator=gen)
        g, beta = -0.2 * torch.rand(B, H, T, generator=gen), torch.rand(B, H, T, generator=gen)
        state = torch.randn(B, H, K, Dv, generator=gen)
        out, final = qm.delta_rule_chunked(q, k, v, g, beta, state, L=L, S=S)
        s, steps = state, []
        for t in range(T):
            o, s = qm.delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], s)
            steps.append(o)
        assert torch.allclose(out, torch.stack(steps, dim=2), atol=1e-4), f"T={T}"
        assert torch.allclose(final, s, atol=1e-4), f"T={T}"


def test_state_buffers_start_zero_and_update_in_place(recipe):
    model = recipe.build({"size": "tiny", "layers": 2, "seed": 0, "checkpoint": ""})
    names = model.state_buffer_names()
    assert "layers.1.attn.kv_cache.k" in names and "layers.1.attn.kv_cache.v" in names
    assert "layers.0.attn.conv_state" in names and "layers.0.attn.recurrent_state" in names
    buffers = dict(model.named_buffers())
    assert all(not buffers[n].any() for n in names)
    cache = buffers["layers.1.attn.kv_cache.k"]
    pointer = cache.data_ptr()
    run(model, torch.tensor([3, 4, 5]), 0)
    assert cache.data_ptr() == pointer and cache[:, :, :3].any() and not cache[:, :, 3:].any()


# ---------------------------------------------------------------------------------------------
# The recipe


def test_recipe_resolves_max_seq_len_and_chunk_from_the_size(recipe):
    base = {"size": "tiny", "layers": 0, "seed": 0, "checkpoint": "", "max_seq_len": 0, "chunk": 0}
    assert recipe.resolve(base) == {**base, "max_seq_len": 128, "chunk": 8}
    assert recipe.resolve({**base, "size": "35b-a3b"}) == {**base, "size": "35b-a3b", "max_seq_len": 4096, "chunk": 64}
    assert recipe.resolve({**base, "max_seq_len": 64, "chunk": 16}) == {**base, "max_seq_len": 64, "chunk": 16}
    model = recipe.build({**base, "max_seq_len": 64, "chunk": 16})
    assert (model.args.max_seq_len, model.args.chunk) == (64, 16)
    assert model.layers[1].attn.kv_cache.k.shape[2] == 64
    with pytest.raises(InvalidOption, match=r"^qwen_moe option max_seq_len=2: expected an integer >= 4"):
        recipe.resolve({**base, "max_seq_len": 2})


def test_recipe_cuts_depth_and_rejects_unknown_sizes(recipe):
    assert recipe.build({"size": "tiny", "layers": 1, "seed": 0, "checkpoint": ""}).args.n_layers == 1
    with pytest.raises(InvalidOption, match="unknown size 'huge'"):
        recipe.build({"size": "huge", "layers": 0, "seed": 0, "checkpoint": ""})


def test_constant_methods_are_runner_metadata(recipe, model):
    meta = recipe.constant_methods(model)
    assert meta["get_max_seq_len"] == 128 and meta["get_vocab_size"] == 1024 and meta["get_n_layers"] == 4
    assert meta["use_kv_cache"] is True
    assert all(isinstance(v, (bool, int, str)) for v in meta.values())
    assert json.loads(meta["get_mutable_buffer_metadata"])["mutable_buffers"] == model.state_buffer_names()


def test_35b_a3b_has_the_hugging_face_shapes():
    args = qm.SIZES["35b-a3b"].with_layers(4)
    with torch.device("meta"):
        model = qm.Transformer(args, torch.bfloat16)
    p = dict(model.named_parameters())
    # From Qwen/Qwen3.5-35B-A3B's config.json: hidden 2048, 16 q / 2 kv heads of 256, linear heads
    # 16 key / 32 value of 128, conv 4, 256 experts of 512, shared expert 512, vocab 248320.
    assert p["tok_embeddings.weight"].shape == (248_320, 2048)
    assert p["layers.0.attn.w_qkv.weight"].shape == (2 * 16 * 128 + 32 * 128, 2048)
    assert p["layers.0.attn.w_z.weight"].shape == (32 * 128, 2048)
    assert p["layers.0.attn.conv_w"].shape == (8192, 1, 4)
    assert p["layers.0.attn.A_log"].shape == (32,)
    assert p["layers.3.attn.wq.weight"].shape == (16 * 256 * 2, 2048)
    assert p["layers.3.attn.wk.weight"].shape == (2 * 256, 2048)
    assert p["layers.3.attn.wo.weight"].shape == (2048, 16 * 256)
    assert p["layers.0.moe.w_gate_up"].shape == (256, 2 * 512, 2048)
    assert p["layers.0.moe.w_down"].shape == (256, 512, 2048)
    assert p["layers.0.moe.router.weight"].shape == (256, 2048)
    assert p["layers.0.moe.shared.w1.weight"].shape == (512, 2048)
    assert p["layers.0.moe.w_gate_up"].dtype == torch.bfloat16
    assert [type(layer.attn).__name__ for layer in model.layers] == ["GatedDeltaNet"] * 3 + ["Attention"]
    # Every parameter is filled by exactly the Hugging Face tensors, in either expert layout.
    for fused in (True, False):
        targets = qhf.hf_targets(args, fused_experts=fused)
        assert {t.param for t in targets.values()} == set(p)
        shapes = {n: tuple(t.view(p).shape) for n, t in targets.items()}
        assert shapes["model.language_model.layers.3.self_attn.q_proj.weight"] == (8192, 2048)
    assert shapes["model.language_model.layers.0.mlp.experts.255.down_proj.weight"] == (2048, 512)


# ---------------------------------------------------------------------------------------------
# torch.export and AOTInductor


@pytest.fixture(scope="module")
def exported(recipe, model):
    model.reset_state()
    programs = {}
    with torch.no_grad():
        for method in recipe.methods:
            shapes = method.dynamic_shapes(model) if method.dynamic_shapes else None
            programs[method.name] = torch.export.export(model, method.inputs(model), dynamic_shapes=shapes, strict=False)
    return programs


def test_export_keeps_the_kv_caches_zero(recipe):
    # ExecuTorch's low-memory CUDA path frees buffers named *kv_cache* only if they are all zero.
    model = recipe.build({"size": "tiny", "layers": 2, "seed": 0, "checkpoint": ""})
    method = recipe.methods[0]
    ep = torch.export.export(model, method.inputs(model), strict=False)
    caches = {n: t for n, t in {**ep.state_dict, **ep.constants}.items() if "kv_cache" in n}
    assert sorted(caches) == ["layers.1.attn.kv_cache.k", "layers.1.attn.kv_cache.v"]
    assert not any(t.any() for t in caches.values())
    assert not any(b.any() for b in model.buffers())


@pytest.fixture(scope="module")
def decomposed(exported):
    """The core-ATen programs that lowering sees (functionalized: mutations become outputs)."""
    return {name: ep.run_decompositions() for name, ep in exported.items()}


def test_lowered_programs_mutate_every_state_buffer(decomposed, model):
    for ep in decomposed.values():
        assert sorted(ep.graph_signature.buffers_to_mutate.values()) == model.state_buffer_names()


def test_lowered_graphs_use_no_forbidden_ops(decomposed):
    forbidden = ("topk", "sort", "nonzero", "linalg", "scaled_dot_product", "cumsum", "repeat_interleave", "conv")
    for name, ep in decomposed.items():
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert not [op for op in ops if any(f in op for f in forbidden)], name


def test_exported_decode_matches_eager(exported, model, tokens):
    got = exported["decode"].module()(tokens[None, :1], torch.tensor([0]))
    assert close(got[0], run(model, tokens[:1], 0), tol=1e-5)


def test_exported_prefill_is_one_graph_for_every_length(exported, model, tokens):
    ep = exported["prefill"]
    (bounds,) = ep.range_constraints.values()
    assert (bounds.lower, bounds.upper) == (2, model.args.max_seq_len - 1)
    for T in (5, SEQ):
        got = ep.module()(tokens[None, :T], torch.arange(T))
        assert close(got[0], run(model, tokens[:T], 0), tol=1e-5), f"T={T}"


@pytest.mark.slow
def test_aoti_compiles_both_methods_on_cpu_with_only_matmul_fallbacks(exported, model, tokens, tmp_path):
    from cudabuild.backend.fallbacks import collect_fallbacks

    runners = {}
    for name, ep in exported.items():
        with collect_fallbacks() as seen, torch.no_grad():
            package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / f"{name}.pt2"))
        # On CPU the matmuls are calls into aten; everything else is generated code.
        assert seen <= {"aoti_torch_cpu_mm_out", "aoti_torch_cpu_bmm_out", "aoti_torch_cpu_addmm_out"}, name
        runners[name] = torch._inductor.aoti_load_package(package)
    with torch.no_grad():
        assert close(runners["decode"](tokens[None, :1], torch.tensor([0]))[0], run(model, tokens[:1], 0), tol=1e-4)
        for T in (5, SEQ):
            got = runners["prefill"](tokens[None, :T], torch.arange(T))[0]
            assert close(got, run(model, tokens[:T], 0), tol=1e-4), f"T={T}"

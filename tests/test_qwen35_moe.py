"""ExecuTorch's Qwen3.5-MoE as the cuda form of recipes/qwen_moe.py, on the CPU: what can run here.

ExecuTorch's Triton kernels need a GPU, and its int4 linears (torchao's tile-packed layout) are
packed on one; the quantize stage's steps run here with qlinear=8w, which torchao packs on the
CPU. The CPU checks the bundle (stock format, read back by ExecuTorch's own loader), the quantize
stage's key, the options, and the exported decode method (the stock signature and metadata).
The GPU half (builds, verify, ExecuTorch's C++ runtime) is tests/gpu/test_qwen_moe_cuda.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import _qwen35_moe_stock_quantize as stock
from conftest import REPO
from cudabuild.backend import custom_ops, sampled_logits
from cudabuild.config import load_config
from cudabuild.engine.graph import Result, Stage
from cudabuild.engine.hashing import digest
from cudabuild.engine.store import Store
from cudabuild.models import qwen35_moe as q
from cudabuild.models import qwen35_moe_cuda as cuda
from cudabuild.models import qwen35_moe_quantize as quant
from cudabuild.models import qwen35_moe_weights as weights
from cudabuild.pipeline import PIPELINE
from cudabuild.registry import load_recipe

DEFAULTS = load_recipe(REPO, "qwen_moe").for_target("cuda").defaults("cuda")  # the recipe's table: the stock exporter's
OPTIONS = q.resolve(DEFAULTS.replace(qlinear="8w"))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bundle")
    quant.quantize(OPTIONS, folder, "cpu")
    return folder


@pytest.fixture(scope="module")
def model(bundle):
    custom_ops.register("cuda")  # the Triton ops its forward calls, as the export stage registers them
    return cuda.load(OPTIONS, bundle)


@pytest.fixture(scope="module")
def decode(model):
    cuda.prepare_decode(model, OPTIONS)
    with torch.no_grad():
        return torch.export.export(model, cuda.decode_inputs(model), strict=True)


def test_the_bundle_is_the_stock_format_and_the_stock_loader_reads_it(bundle):
    from executorch.examples.models.qwen3_5_moe.export import load_prequantized_model
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoEConfig

    assert sorted(p.name for p in bundle.iterdir()) == ["config.json", "model.safetensors"]
    config = Qwen35MoEConfig.from_hf_config(str(bundle / "config.json"))
    assert (config.num_hidden_layers, config.num_experts, config.hidden_size) == (4, 8, 128)
    model, _ = load_prequantized_model(str(bundle), max_seq_len=32)
    experts = model.layers[0].mlp.experts
    assert experts.w1.dtype == torch.int8 and experts.w1.shape == (8, 256, 64)  # int4 packed two a byte
    assert type(model.layers[0].attn.in_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"


def test_the_bundle_holds_the_quantized_weights_and_no_runtime_state(bundle):
    # The same seed and options quantized again give the same tensors as the bundle holds.
    from executorch.examples.models.qwen3_5_moe.quantize_and_save import load_quantized_state_dict

    saved = load_quantized_state_dict(str(bundle / "model.safetensors"))
    assert not [k for k in saved if any(m in k for m in weights.RUNTIME_BUFFERS)]
    config = weights.model_config(OPTIONS)
    again = weights.seeded_model(config, OPTIONS.seed)
    stock.quantize_model(again, config, OPTIONS, "cpu")
    fresh = dict(stock.weights(again))
    assert sorted(fresh) == sorted(saved)
    for name in ("layers.0.mlp.experts.w1", "layers.1.attn.qkv_proj.weight", "lm_head.weight", "embed_tokens.weight"):
        a, b = fresh[name], saved[name]
        inner = getattr(a, "__tensor_flatten__", None)
        pairs = [(getattr(a, n), getattr(b, n)) for n in inner()[0]] if inner else [(a, b)]
        assert all(torch.equal(x, y) for x, y in pairs), name


def test_the_exported_decode_has_the_stock_signature_and_metadata(model, decode):
    from executorch.examples.models.qwen3_5_moe.export import _mutable_buffer_metadata_json

    assert decode.graph_signature.user_inputs == ("tokens", "input_pos", "temperature")
    out = [n for n in decode.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
    assert (tuple(out.shape), out.dtype) == ((1, 1), torch.float32)  # a sampled token id
    ops = {str(n.target) for n in decode.graph.nodes if n.op == "call_function"}
    assert {"triton.fused_moe.default", "triton.fused_deltanet_decode.default", "triton.sdpa_decode_splitk.default"} <= ops
    metadata = q.metadata(model)
    assert metadata["get_mutable_buffer_metadata"] == _mutable_buffer_metadata_json(model)
    assert (metadata["get_max_seq_len"], metadata["get_vocab_size"], metadata["get_n_layers"]) == (64, 256, 4)


def test_the_chunked_delta_rule_is_handed_contiguous_tensors(model):
    # Its FLA kernels read every input as contiguous [B, T, H, *]; ExecuTorch's layer hands it a
    # strided view of v (custom_ops.hand_the_delta_rule_contiguous_tensors). A strided v must give what its
    # contiguous copy gives. The exported program keeps the stock call, v strided as the layer
    # makes it: the copy happens inside the op, eagerly and in the decomposition AOTInductor
    # compiles (tests/gpu's verify compares the two).
    if not hasattr(torch.ops.triton, "chunk_gated_delta_rule") or not torch.cuda.is_available():
        pytest.skip("the chunked delta rule needs fla-core and a GPU (the GPU machine has both)")
    B, T, H, K = 1, 9, 2, 64
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).cuda()

    q, k = (torch.nn.functional.normalize(rand(B, T, H, K), dim=-1).bfloat16() for _ in range(2))
    v = rand(B, H * K, T).bfloat16().transpose(1, 2).reshape(B, T, H, K)  # the layer's kind of view
    assert not v.is_contiguous()
    g, beta, state = -rand(B, T, H).abs(), rand(B, T, H).sigmoid().bfloat16(), torch.zeros(B, H, K, K).cuda()
    strided = torch.ops.triton.chunk_gated_delta_rule(q, k, v, g, beta, state)
    dense = torch.ops.triton.chunk_gated_delta_rule(q, k, v.contiguous(), g, beta, state)
    for got, want in zip(strided, dense):  # a scrambled read is off by about the values' own size
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)

    layer = model.layers[0].attn
    x = torch.randn(1, T, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype)
    with torch.no_grad():
        program = torch.export.export(layer, (x, torch.arange(T)), strict=True)
    calls = [n for n in program.graph.nodes if str(n.target) == "triton.chunk_gated_delta_rule.default"]
    assert len(calls) == 1 and not calls[0].args[2].meta["val"].is_contiguous()


@pytest.mark.parametrize("named", [True, False], ids=["state named", "state not named"])
def test_the_reference_streams_the_quantized_weights_to_another_device(model, decode, named):
    """The reference's streamed run of the cuda form on a device that is not the host's (here
    `meta`: the Triton ops have shapes there, not values, as the CPU cannot run them): its state
    moves there for good, whether or not the caller names it (torch 2.11 named only part of it on
    the GPU machine, 2026-12-07); its weights, torchao tensor subclasses, which take no
    `to(copy=True)`, are copied op by op and stay on the host."""
    from cudabuild.backend.streamed_eager import StreamedProgram

    names = sampled_logits.program_buffers(decode)
    streamed = StreamedProgram(decode, "meta", resident=names if named else ())
    for step in cuda.decode_steps(model)[:2]:
        out, _ = streamed.run(tuple(step))
        assert out[0].device.type == "meta" if isinstance(out, (list, tuple)) else out.device.type == "meta"
    held = dict(streamed.gm.named_buffers())
    assert streamed.resident == names and all(held[n].device.type == "meta" for n in names)
    assert streamed.copied_bytes > 0 and all(t.device.type == "cpu" for t in decode.state_dict.values())


def test_verify_finds_the_logits_the_sampler_draws_from(model, decode):
    node = sampled_logits.logits_node(decode.module(), temperature_input=2)
    assert tuple(node.meta["val"].shape) == (1, model.config.vocab_size)
    assert node.meta["val"].dtype == torch.float32


def test_verify_judges_the_chosen_token_by_the_eager_logits_and_every_state():
    logits = torch.tensor([[0.10, 0.50, 0.49, -0.3]])
    eager = [(None, logits), (None, logits)]
    states = {"kv": torch.ones(4)}
    near = sampled_logits.judge(eager, [torch.tensor([[1.0]]), torch.tensor([[2.0]])], states, states, 5e-2)
    assert near["passed"] and [s["rank"] for s in near["steps"]] == [0, 1]
    far = sampled_logits.judge(eager, [torch.tensor([[1.0]]), torch.tensor([[3.0]])], states, states, 5e-2)
    assert not far["passed"] and far["steps"][1]["eager_argmax"] == 1
    drifted = sampled_logits.judge(eager[:1], [torch.tensor([[1.0]])], states, {"kv": torch.full((4,), 1.2)}, 5e-2)
    assert not drifted["passed"] and drifted["states_compared"] == "1 of 1"


def _inputs(config, stage: Stage) -> dict:
    stamps = {"probe": Result("p", {"torch": "2.13", "executorch": "1.4.1", "torchao": "0.18.0"}),
              "quantize": Result("q"), "export.decode": Result("e1"), "export.prefill": Result("e2")}
    return PIPELINE.inputs(stage, config, lambda s: stamps.get(s.id), lambda: {}, lambda folder=None: None)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store(tmp_path_factory.mktemp("cache"))


def _config(store, **settings):
    return load_config(REPO, {"model": "qwen_moe", "target": "cuda", **settings}, store)


def test_the_quantize_stage_is_in_the_cuda_build_only(store):
    assert [s.id for s in PIPELINE.plan(_config(store))][:3] == ["probe", "quantize", "trace.decode"]
    cpu = load_config(REPO, {"model": "qwen_moe", "target": "cpu"}, store)
    assert "quantize" not in [s.id for s in PIPELINE.plan(cpu)]
    assert "weights" not in _inputs(cpu, Stage("export", "decode"))  # its keys are what they were


@pytest.mark.parametrize("settings", [
    {"max_seq_len": "32"}, {"dense_prefill": "dequant"}, {"moe_activation_dtype": "int8"}, {"splitk": "false"},
    {"max_autotune": "ON"}, {"decode.low_memory_mode": "ON"}, {"compile_wrapper_opt_level": "O1"},
])
def test_export_and_compile_settings_never_rerun_quantize(store, settings):
    base = digest(_inputs(_config(store), Stage("quantize")))
    assert digest(_inputs(_config(store, **settings), Stage("quantize"))) == base


@pytest.mark.parametrize("settings", [
    {"qlinear": "8w"}, {"qlinear_group_size": "64"}, {"hqq": "true"}, {"qembedding": "8w"}, {"seed": "7"},
    {"size": "35b-a3b"}, {"layers": "2"},
])
def test_what_decides_the_weights_reruns_quantize(store, settings):
    base = digest(_inputs(_config(store), Stage("quantize")))
    assert digest(_inputs(_config(store, **settings), Stage("quantize"))) != base


def test_exports_key_on_the_quantized_weights(store):
    inputs = _inputs(_config(store), Stage("export", "prefill"))
    assert inputs["weights"] == "q" and inputs["strict"] is True


def test_a_new_seed_on_cuda_keeps_the_trace_and_reruns_export(store):
    """The trace keys on the quantized weights' layout (the quantize stage's `layout` facet) and the
    options but the seed; export on the quantized weights themselves."""
    def inputs(stage, quantized, **settings):
        stamps = {"probe": Result("p", {"torch": "2.13"}), "quantize": quantized,
                  "trace.prefill": Result("t", {"facets": {"code": "k"}})}
        return PIPELINE.inputs(stage, _config(store, **settings), lambda s: stamps.get(s.id), lambda: {},
                               lambda folder=None: None)

    seed_42, seed_7 = Result("q42", {"facets": {"layout": "L"}}), Result("q7", {"facets": {"layout": "L"}})
    trace, export = Stage("trace", "prefill"), Stage("export", "prefill")
    assert digest(inputs(trace, seed_7, seed="7")) == digest(inputs(trace, seed_42))
    assert "seed" not in inputs(trace, seed_42)["options"] and inputs(trace, seed_42)["strict"] is True
    assert digest(inputs(export, seed_7, seed="7")) != digest(inputs(export, seed_42))
    assert digest(inputs(trace, Result("q8w", {"facets": {"layout": "L8"}}), qlinear="8w")) != digest(inputs(trace, seed_42))


@pytest.mark.parametrize("settings, message", [
    (["target=cuda", "chunk=8"], "qwen_moe option chunk=8 applies to target cpu only, not cuda"),
    (["target=cpu", "qlinear=4w"], "qwen_moe option qlinear=4w applies to target cuda only, not cpu"),
    (["target=cuda", "qlinear=2w"], "qwen_moe option qlinear=2w: expected one of 4w, 8w, 8da4w (default 4w)"),
    (["target=cuda", "dense_prefill=dequant", "qlinear=8w"], "dense_prefill=dequant needs qlinear=4w"),
    (["target=cuda", "max_seq_len=3"], "max_seq_len=3: expected an integer >= 4"),
])
def test_an_option_the_model_cannot_take_stops_the_build_before_anything_runs(project, settings, message):
    done = project.export("model=qwen_moe", *settings)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("cudabuild: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert not (project.root / "build").exists()


def test_a_prequantized_bundle_decides_its_own_quantization(project, bundle):
    done = project.export("model=qwen_moe", "target=cuda", f"prequantized={bundle}", "qlinear=8w")
    assert done.returncode == 2 and "prequantized= decides" in done.stderr and "drop qlinear=8w" in done.stderr
    (project.root / "notabundle").mkdir()
    done = project.export("model=qwen_moe", "target=cuda", f"prequantized={project.root / 'notabundle'}")
    assert done.returncode == 2 and "no config.json there" in done.stderr


def test_the_adopted_bundle_is_loaded_where_it_lies(bundle, tmp_path):
    written = quant.quantize(OPTIONS.replace(prequantized=str(bundle)), tmp_path, "cpu")
    assert list(written) == [quant.ADOPTED]
    assert json.loads(written[quant.ADOPTED].read_text()) == {"folder": str(bundle.resolve())}
    loaded = cuda.load(OPTIONS.replace(prequantized=str(bundle)), tmp_path)
    assert loaded.config.num_hidden_layers == 4


def _bundle_tensors(path) -> dict:
    from executorch.examples.models.qwen3_5_moe.quantize_and_save import load_quantized_state_dict

    return {name: _inner(t) for name, t in load_quantized_state_dict(str(path)).items()}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_drawn_weights_are_the_same_tensors_whatever_the_number_of_layers(tmp_path):
    """Past the tiny size each tensor is drawn by its own generator (seed, name), a part at a time:
    a cut model's bundle holds the first layers of the whole one's, and a second run the same bytes."""
    options = OPTIONS.replace(size="35b-a3b")  # the drawn path, at the tiny shapes of `config` below
    full, cut = weights.model_config(OPTIONS), weights.model_config(OPTIONS.replace(layers=2))
    quant.quantize_streamed(options, full, tmp_path / "full.safetensors", "cpu")
    quant.quantize_streamed(options, full, tmp_path / "again.safetensors", "cpu")
    quant.quantize_streamed(options.replace(layers=2), cut, tmp_path / "cut.safetensors", "cpu")
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "again.safetensors").read_bytes()
    whole, first = _bundle_tensors(tmp_path / "full.safetensors"), _bundle_tensors(tmp_path / "cut.safetensors")
    assert sorted(first) == sorted(n for n in whole if not n.startswith(("layers.2.", "layers.3.")))
    assert all(_same(first[n], whole[n]) for n in first)


def test_a_checkpoint_streamed_a_part_at_a_time_quantizes_as_the_whole_model_does(tmp_path):
    """The streamed quantizer reads a checkpoint a part at a time (ExecuTorch's lazy subset reader);
    its bundle holds exactly what the stock whole-model path makes of the same checkpoint."""
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoE

    import _qwen35_moe_hf as qwen35_moe_hf

    qwen35_moe_hf.save(tmp_path / "ckpt", qwen35_moe_hf.config_json(dtype="bfloat16"), shards=2, seed=3)
    options = OPTIONS.replace(checkpoint=str(tmp_path / "ckpt"))
    config = weights.model_config(options)
    quant.quantize_streamed(options, config, tmp_path / "streamed.safetensors", "cpu")
    whole, _ = Qwen35MoE.from_hf_checkpoint(str(tmp_path / "ckpt"), max_seq_len=64)
    whole = weights._frozen(whole.to(torch.bfloat16))
    stock.quantize_model(whole, config, options, "cpu")
    want = {n: _inner(t) for n, t in stock.weights(whole)}
    got = _bundle_tensors(tmp_path / "streamed.safetensors")
    assert sorted(got) == sorted(want)
    assert [n for n in want if not _same(got[n], want[n])] == []


def _inner(t) -> list:
    t = t.data if isinstance(t, torch.nn.Parameter) else t
    inner = getattr(t, "__tensor_flatten__", None)
    return [getattr(t, n) for n in inner()[0]] if inner else [t]


def test_the_fp32_truth_computes_prefill_and_token_by_token_decode_alike(bundle):
    """The truth's plain ops, checked against each other: a 9-token prompt at once (the chunked
    delta rule's answer, the batched MoE's) and the same tokens one at a time (the decode kernels')
    leave the same state, to fp32's rounding; bf16 runs stray from it by more than that."""
    from cudabuild.models import qwen35_moe_fp32 as fp32

    tokens = ((torch.arange(9) * 37 + 11) % 256)[None]
    prompt = [(tokens, torch.arange(9), None)]
    one_by_one = [(tokens[:, i:i + 1], torch.tensor([i]), None) for i in range(9)]
    at_once = fp32.truth(OPTIONS, bundle, cuda.prepare_prefill, prompt, "cpu")
    stepped = fp32.truth(OPTIONS, bundle, cuda.prepare_decode, one_by_one, "cpu")
    assert sorted(at_once["truth"]["states"]) == sorted(stepped["truth"]["states"]) != []
    for name, state in at_once["truth"]["states"].items():
        assert state.dtype == torch.float32
        torch.testing.assert_close(state, stepped["truth"]["states"][name], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(at_once["truth"]["logits"][-1], stepped["truth"]["logits"][-1], atol=1e-5, rtol=1e-5)
    assert at_once["runs"] == 1 + fp32.NOISY_RUNS
    assert sorted(at_once["envelope"]["states"]) == sorted(at_once["truth"]["states"])
    assert min(at_once["envelope"]["states"].values()) > 1e-5  # bf16 strays further than fp32's own rounding
    assert len(at_once["envelope"]["deviations"]) == 1 and at_once["envelope"]["deviations"][0] > 1e-5


def test_verify_judges_by_the_truth_where_there_is_one():
    """A compiled state far from the bf16 eager run but no further from the fp32 truth than bf16
    runs are passes; one far outside what bf16 does fails, and the report says by how much."""
    truth_state, eager_state = torch.zeros(4, 8), torch.full((4, 8), 0.5)  # bf16 lies 0.5 from the truth
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    truth = {"truth": {"logits": [logits], "states": {"s": truth_state}},
             "envelope": {"states": {"s": 0.5}, "gaps": [0.1]}}
    eager = [(torch.tensor([[1]]), logits)]
    near = sampled_logits.judge(eager, [torch.tensor([[2]])], {"s": eager_state}, {"s": torch.full((4, 8), -0.6)},
                                0.05, truth=truth)
    assert near["passed"] and near["judged_by"] == "truth"
    assert near["states"][0]["truth_diff"] == pytest.approx(0.6) and near["states"][0]["max_abs_diff"] == pytest.approx(1.1)
    far = sampled_logits.judge(eager, [torch.tensor([[3]])], {"s": eager_state}, {"s": torch.full((4, 8), 2.0)},
                               0.05, truth=truth)
    assert not far["passed"]
    assert [s["ok"] for s in far["steps"]] == [False] and far["steps"][0]["truth_gap"] == pytest.approx(4.0)
    assert far["states"][0]["allowed"] == pytest.approx(sampled_logits.MARGIN * 0.5)
    # Without a truth, the same compiled state is judged against the eager run, as before.
    assert not sampled_logits.judge(eager, [torch.tensor([[2]])], {"s": eager_state}, {"s": torch.full((4, 8), -0.6)},
                                    0.05)["passed"]


def test_a_token_is_allowed_what_bf16s_logit_deviation_allows():
    """Flat logits: the bf16 runs all chose near the best (gap 0.1), but their logits strayed up to
    0.4 from the truth's, so a program that close may pick a token up to 0.8 below the best
    (2 x 0.4); 0.9 below is further than any logits that close can choose."""
    logits = torch.tensor([3.0, 2.25, 2.1, -1.0])
    truth = {"truth": {"logits": [logits], "states": {}},
             "envelope": {"states": {}, "gaps": [0.1], "deviations": [0.4]}}
    eager = [(torch.tensor([[0]]), logits)]
    within = sampled_logits.judge(eager, [torch.tensor([[1]])], {}, {}, 0.005, truth=truth)
    assert within["passed"] and within["steps"][0]["allowed"] == pytest.approx(0.8)
    assert within["steps"][0]["bf16_logit_deviation"] == pytest.approx(0.4)
    beyond = sampled_logits.judge(eager, [torch.tensor([[2]])], {}, {}, 0.005, truth=truth)
    assert not beyond["passed"] and beyond["steps"][0]["truth_gap"] == pytest.approx(0.9)
    # Without the deviations (a truth stored before them), only the picks' spread counts.
    del truth["envelope"]["deviations"]
    assert not sampled_logits.judge(eager, [torch.tensor([[1]])], {}, {}, 0.005, truth=truth)["passed"]


def test_an_eager_reference_far_outside_bf16s_spread_is_called_wrong_not_the_compiled_code():
    exact = {"layers.0.attn.recurrent_state": torch.zeros(2, 2)}
    truth = {"truth": {"logits": [torch.tensor([1.0, 0.0])], "states": exact},
             "envelope": {"states": {"layers.0.attn.recurrent_state": 1e-4}, "gaps": [0.0]},
             "eager": {"states": {"layers.0.attn.recurrent_state": 0.0236}, "gaps": [0.0]}}
    eager = [(torch.tensor([[0]]), torch.tensor([1.0, 0.0]))]
    report = sampled_logits.judge(eager, [torch.tensor([[0]])], exact, exact, 0.005, truth=truth)
    assert not report["passed"] and all(s["ok"] for s in report["steps"] + report["states"])
    assert report["reference"]["worst"]["buffer"] == "layers.0.attn.recurrent_state"
    # Its token too: one 1.46 below the truth's best where every bf16 run chose the best.
    truth["eager"] = {"states": {"layers.0.attn.recurrent_state": 0.0}, "gaps": [1.0]}
    report = sampled_logits.judge(eager, [torch.tensor([[0]])], exact, exact, 0.005, truth=truth)
    assert not report["passed"] and report["reference"]["worst"]["buffer"].startswith("step 0's token")


def test_a_checkpoint_of_new_values_keeps_the_trace_key_and_one_of_another_layout_does_not(store, tmp_path):
    """The trace keys on a checkpoint's layout (each tensor's dtype and shape, config.json), not its
    bytes nor its folder's path: a nightly's next checkpoint, wherever it lies, traces nothing;
    export keys on its content. (Real checkpoints in the released naming; a real Runner's keys.)"""
    from cudabuild.engine.runner import Runner
    import _qwen35_moe_hf as qwen35_moe_hf

    def keys(folder) -> tuple[str, str]:
        runner = Runner(load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(folder)}, store),
                        store, "test")
        results = {"probe": Result("p", {"torch": "2.13"}), "trace.decode": Result("t", {"facets": {"code": "k"}})}
        return tuple(digest(runner.inputs(Stage(kind, "decode"), read=lambda s: results.get(s.id)))
                     for kind in ("trace", "export"))

    trace, export = keys(qwen35_moe_hf.save(tmp_path / "nightly-1", seed=1))
    again_trace, again_export = keys(qwen35_moe_hf.save(tmp_path / "nightly-2", seed=2))
    assert again_trace == trace and again_export != export
    in_place = qwen35_moe_hf.save(tmp_path / "nightly-1", seed=3)  # rewritten where it was: new bytes
    assert keys(in_place)[0] == trace and keys(in_place)[1] != export
    other_dtype = qwen35_moe_hf.save(tmp_path / "bf16", qwen35_moe_hf.config_json(dtype="bfloat16"), seed=1)
    assert keys(other_dtype)[0] != trace

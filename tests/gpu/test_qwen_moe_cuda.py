"""ExecuTorch's Qwen3.5-MoE through target cuda on a real GPU: the build verifies, ExecuTorch's own
C++ CUDA runtime runs the package right, and the recipe's two forms are one model.

Run on the GPU machine: `python -m pytest tests/gpu -q` (skipped where torch sees no CUDA device).
The runtime test needs ExecuTorch's command-line runner (the et-runtime folder: $ET_CUDA_RUN names
its run.sh, else .etrt/run.sh in the checkout, else ../shared/et-runtime/run.sh) and is skipped
without it. $CUDABUILD_KERNEL_CACHE, when set, is handed to the builds (compiled Triton kernels
shared with other builds on the machine; they are keyed by content).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, assert_ok

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = 1e-6


def _runner() -> Path | None:
    for candidate in (os.environ.get("ET_CUDA_RUN"), REPO / ".etrt" / "run.sh", REPO.parent / "shared" / "et-runtime" / "run.sh"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from conftest import new_project

    project = new_project(tmp_path_factory.mktemp("qwen-cuda"))
    shared = {"CUDABUILD_KERNEL_CACHE": os.environ["CUDABUILD_KERNEL_CACHE"]} if os.environ.get("CUDABUILD_KERNEL_CACHE") else {}
    assert_ok(project.export("model=qwen_moe", "target=cuda", env=project.env(**shared)))
    return project


def _bundle_model(project):
    """ExecuTorch's model, eager on the GPU, from the quantize stage's bundle in the project's cache."""
    import tempfile

    from cudabuild.backend import custom_ops
    from cudabuild.engine.store import Store
    from cudabuild.models import qwen35_moe_cuda
    from cudabuild.registry import load_recipe
    from executorch.examples.models.qwen3_5_moe.inference import _move_to_cuda

    custom_ops.register("cuda")  # the Triton ops the model's forward calls, with their fixes
    manifest = project.manifest("qwen_moe", "cuda")
    stamp = json.loads((project.root / "build/qwen_moe/cuda/.stamps/quantize.json").read_text())
    folder = Path(tempfile.mkdtemp(prefix="bundle-"))
    store = Store(project.cache)
    for name, sha in stamp["outputs"].items():
        (folder / name).symlink_to(store.objects.verified_path(sha))
    options = load_recipe(REPO, "qwen_moe").for_target("cuda").defaults("cuda").replace(**manifest["options"])
    model = qwen35_moe_cuda.load(options, folder)
    _move_to_cuda(model, model.config)
    return model.eval(), options


def test_the_build_verifies_logits_and_state_of_both_methods(built):
    manifest = built.manifest("qwen_moe", "cuda")
    assert {s["stage"] for s in manifest["stages"]} >= {"quantize", "export", "edge", "compile", "package", "reference", "verify"}
    for method in ("decode", "prefill"):
        report = manifest["verify"][method]
        assert report["passed"] and report["steps"] >= 2, report
        compared, of = report["states_compared"].split(" of ")
        assert int(compared) > 0, report  # KV caches, conv and recurrent states were compared
    pte = (built.root / "build/qwen_moe/cuda/model.pte").read_bytes()
    assert b"CudaBackend" in pte and b"_so_blob" in pte


def test_a_spec_change_does_not_quantize_again(built):
    assert_ok(built.export("model=qwen_moe", "target=cuda", "decode.compile_wrapper_opt_level=O1"))
    statuses = built.statuses("qwen_moe", "cuda")
    assert statuses["quantize"] == statuses["export.decode"] == statuses["edge.decode"] == "cached"
    assert statuses["compile.decode"] == "ran" and statuses["compile.prefill"] == "cached"
    # The eager reference depends on the export alone: verify compares the new compile with it.
    assert statuses["reference.decode"] == "cached" and statuses["verify.decode"] == "ran"


def _write(folder: Path, name: str, tensor) -> str:
    path = folder / f"{name}.bin"
    tensor.contiguous().numpy().tofile(path)
    dtype = {torch.int64: "int64", torch.float32: "float32"}[tensor.dtype]
    return f"{dtype}:{'x'.join(map(str, tensor.shape))}:{path}"


def _near_argmax(logits, token: int) -> bool:
    return float(logits.max() - logits[token]) <= 5e-2 * float(logits.abs().max())


@pytest.mark.skipif(_runner() is None, reason="ExecuTorch's C++ CUDA runner (et-runtime) is not here")
def test_executorch_runtime_runs_prefill_then_decode_with_the_state_shared(built, tmp_path):
    import numpy as np

    from cudabuild.models import qwen35_moe_cuda

    model, options = _bundle_model(built)
    P = 9
    prompt = (torch.arange(P) * 37 + 11) % model.config.vocab_size
    with torch.no_grad():
        qwen35_moe_cuda.prepare_prefill(model, options)
        after_prompt = model(prompt[None].cuda(), torch.arange(P).cuda()).float()[0, -1].cpu()
        first = int(after_prompt.argmax())
        qwen35_moe_cuda.prepare_decode(model, options)
        after_first = model(torch.tensor([[first]]).cuda(), torch.tensor([P]).cuda()).float()[0, -1].cpu()
    temperature = torch.tensor([GREEDY])
    build = built.root / "build/qwen_moe/cuda"
    # Decode is fed the eager model's token, so both sides continue the same sequence; the weights
    # and the state (KV caches, conv and recurrent states) are shared by name between the methods.
    done = subprocess.run(
        [str(_runner()), str(build / "model.pte"), str(build / "aoti_cuda_blob.ptd"), "prefill", str(tmp_path / "out"),
         _write(tmp_path, "prompt", prompt[None]), _write(tmp_path, "pos", torch.arange(P)), _write(tmp_path, "t", temperature),
         "--then", "decode", _write(tmp_path, "tok", torch.tensor([[first]])), _write(tmp_path, "dpos", torch.tensor([P])),
         _write(tmp_path, "t", temperature)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["out_0", "float32", "1x1", "1_decode/out_0", "float32", "1x1"]
    prefill_token = int(np.fromfile(tmp_path / "out" / "out_0.bin", dtype=np.float32)[0])
    decode_token = int(np.fromfile(tmp_path / "out" / "1_decode" / "out_0.bin", dtype=np.float32)[0])
    assert _near_argmax(after_prompt, prefill_token), (prefill_token, int(after_prompt.argmax()))
    assert _near_argmax(after_first, decode_token), (decode_token, int(after_first.argmax()))


def test_the_cpu_form_computes_the_cuda_forms_logits_from_one_checkpoint(tmp_path):
    """One Hugging Face checkpoint, read by ExecuTorch's loader into ExecuTorch's model, its experts
    packed to int4 as its exporter packs them. The CUDA form runs that module on ExecuTorch's Triton
    kernels; the CPU form is a copy of the same module through the source transformation
    (cudabuild/models/qwen35_moe_plain.py: the same names and weights, the int4 experts dequantized,
    plain PyTorch in place of every Triton op). On the GPU both compute in bf16, and the plain
    form gives the Triton form's logits after a prompt and after a decode step."""
    import copy

    from cudabuild.backend import custom_ops
    import _qwen35_moe_hf as qwen35_moe_hf
    from cudabuild.models import qwen35_moe_plain as plain
    from cudabuild.models import qwen35_moe_weights as weights
    from executorch.examples.models.qwen3_5_moe.export import _materialize_buffers, _quantize_experts_int4
    from executorch.examples.models.qwen3_5_moe.inference import _move_to_cuda
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoE

    custom_ops.register("cuda")
    folder = qwen35_moe_hf.save(tmp_path / "ckpt", qwen35_moe_hf.config_json(dtype="bfloat16"))
    theirs, config = Qwen35MoE.from_hf_checkpoint(str(folder), max_seq_len=64)
    theirs = weights._frozen(theirs.to(dtype=torch.bfloat16))
    _quantize_experts_int4(theirs, config, 32)
    _materialize_buffers(theirs, config)
    ours = copy.deepcopy(theirs)
    assert plain.plain_source_transformations(ours, chunk=8)["PlainMoEExperts"] == config.num_hidden_layers
    _move_to_cuda(theirs, config)
    _move_to_cuda(ours, config)

    prompt = ((torch.arange(9) * 37 + 11) % config.vocab_size)[None].cuda()
    with torch.no_grad():
        want = theirs(prompt, torch.arange(9).cuda()).float()[0, -1]  # no temperature: the logits [1, T, V]
        got = ours(prompt, torch.arange(9).cuda()).float()[0, -1]
        token = torch.tensor([[int(want.argmax())]]).cuda()
        want_next = theirs(token, torch.tensor([9]).cuda()).float()[0, -1]
        got_next = ours(token, torch.tensor([9]).cuda()).float()[0, -1]
    for w, g in ((want, got), (want_next, got_next)):
        assert (w - g).abs().max() <= 5e-2 * max(1.0, float(w.abs().max())), float((w - g).abs().max())
        assert _near_argmax(w, int(g.argmax()))


def test_the_real_shapes_build_verifies_against_the_fp32_truth(tmp_path):
    """`size=35b-a3b layers=4` (its fourth layer is the first full-attention one) builds and
    verifies, judged by the fp32 truth of the same weights (cudabuild.models.qwen35_moe_fp32). This
    failed verify until 2026-12-06: the reference stage's eager run read the delta rule's `v`
    scrambled, and a 256-expert router flips on bf16's last bit, so bf16 eager was no measure."""
    from conftest import new_project

    project = new_project(tmp_path)
    shared = {"CUDABUILD_KERNEL_CACHE": os.environ["CUDABUILD_KERNEL_CACHE"]} if os.environ.get("CUDABUILD_KERNEL_CACHE") else {}
    done = project.export("model=qwen_moe", "target=cuda", "size=35b-a3b", "layers=4", env=project.env(**shared))
    failed = {p.name: p.read_text()[:2000] for p in (project.root / "build/qwen_moe/cuda").glob("verify-*.failed.json")}
    assert done.returncode == 0, (done.stderr[-2000:], failed)
    for method in ("decode", "prefill"):
        verdict = json.loads((project.root / f"build/qwen_moe/cuda/.stamps/verify.{method}.json").read_text())["value"]
        assert verdict["passed"] and verdict["judged_by"] == "truth", verdict
        reference = json.loads((project.root / f"build/qwen_moe/cuda/.stamps/reference.{method}.json").read_text())
        assert reference["status"] == "ran"


def test_at_the_real_shapes_only_verify_holds_the_weights_on_the_device(tmp_path):
    """Issue 57: with low_memory_mode=ON, `size=35b-a3b layers=4` compiles with its weights on the
    host (Triton's tuning at compile time never runs the program), the reference streams them op
    by op and its truth layer by layer; verify, whose compiled code runs on them, is the one stage
    that holds them all. Each of the others peaks below half the weights' bytes (at 40 layers, a
    fifth of the 19 GiB), and every stage verifies as before."""
    from conftest import new_project

    project = new_project(tmp_path)
    shared = {"CUDABUILD_KERNEL_CACHE": os.environ["CUDABUILD_KERNEL_CACHE"]} if os.environ.get("CUDABUILD_KERNEL_CACHE") else {}
    done = project.export("model=qwen_moe", "target=cuda", "size=35b-a3b", "layers=4", "low_memory_mode=ON",
                          env=project.env(**shared))
    assert done.returncode == 0, done.stderr[-2000:]
    stamps = project.root / "build/qwen_moe/cuda/.stamps"
    weights = json.loads((stamps / "quantize.json").read_text())["value"]["files"]["model.safetensors"]
    peaks = {p.stem: (json.loads(p.read_text())["value"] or {}).get("peak_gpu_bytes") for p in stamps.glob("*.json")}
    print({k: round(v / 2**30, 2) for k, v in peaks.items() if v})  # for the GPU run's log
    for stage in ("compile.decode", "compile.prefill", "reference.decode", "reference.prefill"):
        assert peaks[stage] and peaks[stage] < weights / 2, (stage, peaks[stage], weights)
    for method in ("decode", "prefill"):
        verify = json.loads((stamps / f"verify.{method}.json").read_text())["value"]
        assert verify["passed"] and verify["outside_allocator_bytes"] >= weights * 0.9, verify
        compiled = json.loads((stamps / f"compile.{method}.json").read_text())["value"]
        assert compiled["constants"]["rewritable"], compiled


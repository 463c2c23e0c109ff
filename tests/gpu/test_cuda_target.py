"""tiny_lm through target cuda on a real GPU, low_memory_mode OFF and ON, with verify passing.

Run on the GPU machine: `python -m pytest tests/gpu -q` (skipped where torch sees no CUDA device).
"""

from __future__ import annotations

import pytest

from _faults import one_error_line
from conftest import assert_ok

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    from conftest import new_project

    project = new_project(tmp_path_factory.mktemp("cuda"))
    assert_ok(project.export("model=tiny_lm", "target=cuda"))
    return project


def test_tiny_lm_cuda_builds_and_verifies(cuda_build):
    manifest = cuda_build.manifest("tiny_lm", "cuda")
    assert set(manifest["outputs"]) == {"model.pte", "aoti_cuda_blob.ptd"}
    assert manifest["verify"] and all(v["passed"] for v in manifest["verify"].values())
    pte = (cuda_build.root / "build/tiny_lm/cuda/model.pte").read_bytes()
    assert b"CudaBackend" in pte and b"_so_blob" in pte
    assert manifest["toolchain"]["cuda"]["capability"][0] >= 7


def test_low_memory_mode_builds_verifies_and_lowers_peak_memory(cuda_build):
    assert_ok(cuda_build.export("model=tiny_lm", "target=cuda", "low_memory_mode=ON"))
    statuses = cuda_build.statuses("tiny_lm", "cuda")
    assert statuses["compile.decode"] == statuses["compile.prefill"] == "ran"
    manifest = cuda_build.manifest("tiny_lm", "cuda")
    assert all(v["passed"] for v in manifest["verify"].values())


def test_noop_after_cuda_build_runs_nothing(cuda_build):
    assert_ok(cuda_build.export("model=tiny_lm", "target=cuda"))
    assert set(cuda_build.statuses("tiny_lm", "cuda").values()) <= {"cached", "restored"}


def test_a_forced_mismatch_on_cuda_is_located_in_the_compiled_code(cuda_build, tmp_path):
    # A tolerance no compile meets makes a real mismatch; on cuda the locator must run the edge
    # program eagerly on the device and compare the blob's constants, then name the stage at fault.
    project = cuda_build.copy(tmp_path)
    recipe = project.root / "recipes" / "tiny_lm.py"
    source = recipe.read_text()
    recipe.write_text(source.replace("    constant_methods=metadata,\n)", "    constant_methods=metadata,\n    tolerances={'float32': 1e-12},\n)"))
    line = one_error_line(project.export("model=tiny_lm", "target=cuda"))
    print(line)  # for the GPU run's log
    assert "the edge program matches eager" in line, line
    assert "the weights blob loads all 25 constants exactly: the fault is in the compiled code" in line, line


def test_two_workers_compile_both_methods_on_the_gpu_at_once_once_their_peaks_are_known(cuda_build, tmp_path):
    """After the first build measured each compile's device memory, a rebuild with two workers
    that reruns both compiles (a keyed spec changed) admits them to the GPU together: their spans
    overlap, their admission says they share the device, and both still verify."""
    import json

    project = cuda_build.copy(tmp_path)
    assert_ok(project.export("model=tiny_lm", "target=cuda", "compile_wrapper_opt_level=O0",
                             env=project.env(CUDABUILD_JOBS="2")))
    statuses = project.statuses("tiny_lm", "cuda")
    assert statuses["compile.decode"] == statuses["compile.prefill"] == "ran"
    assert all(v["passed"] for v in project.manifest("tiny_lm", "cuda")["verify"].values())
    events = json.loads((project.root / "build/tiny_lm/cuda/trace.json").read_text())["traceEvents"]
    runs = {e["name"]: e for e in events if e.get("cat") == "stage" and e["args"].get("step") == "execute"}
    decode, prefill = runs["compile.decode"], runs["compile.prefill"]
    overlap = min(decode["ts"] + decode["dur"], prefill["ts"] + prefill["dur"]) - max(decode["ts"], prefill["ts"])
    print("compile overlap (s):", overlap / 1e6)  # for the GPU run's log
    assert overlap > 0.25 * min(decode["dur"], prefill["dur"]), (decode, prefill)
    admitted = [e for e in events if e["name"] == "admitted" and e["args"].get("device") == "cuda"
                and any(r["pid"] == e["pid"] and r["ts"] <= e["ts"] + e["dur"] and e["ts"] <= r["ts"] + r["dur"]
                        for r in (decode, prefill))]
    assert admitted and not any(e["args"]["device_alone"] for e in admitted), [e["args"] for e in admitted]

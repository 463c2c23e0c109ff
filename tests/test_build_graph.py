"""The build graph's promises, end to end with real torch.export, ExecuTorch and AOTInductor:
no-op, early cutoff, per-method reruns, history, restore, and bad input that caches nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from conftest import assert_ok, broken_recipe_text

pytestmark = pytest.mark.slow

STAGES = ["probe", "trace.decode", "trace.prefill", "export.decode", "export.prefill", "edge.decode", "edge.prefill",
          "compile.decode", "compile.prefill", "blob.decode", "blob.prefill", "package", "verify.decode", "verify.prefill"]


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_entries(project) -> set:
    from cudabuild.engine.store import Store

    store = Store(project.cache)
    try:
        return {k for k in store.table.cache.iterkeys() if k.startswith(("blob:", "rec:"))}
    finally:
        store.close()


def test_cold_build_produces_verified_pte_and_ptd(built_tiny):
    out = built_tiny.root / "build" / "tiny_lm" / "cpu"
    manifest = built_tiny.manifest()
    assert [s["status"] for s in manifest["stages"]] == ["ran"] * len(STAGES)
    assert set(manifest["outputs"]) == {"model.pte", "aoti_cpu_blob.ptd"}
    for name, digest in manifest["outputs"].items():
        assert sha(out / name) == digest
    assert manifest["toolchain"]["torch"].startswith("2.")
    assert all(v["passed"] for v in manifest["verify"].values()) and set(manifest["verify"]) == {"decode", "prefill"}
    # The runtime's layout: the .so named by its sha256 inside the .pte, the weights in the .ptd.
    pte = (out / "model.pte").read_bytes()
    assert b"_so_blob" in pte and b"CudabuildAotiCpu" in pte
    assert b"_weights_blob" in (out / "aoti_cpu_blob.ptd").read_bytes()


def test_each_distinct_tensor_is_stored_once(built_tiny):
    stamps = built_tiny.root / "build" / "tiny_lm" / "cpu" / ".stamps"
    outputs = {s: json.loads((stamps / f"{s}.json").read_text())["outputs"] for s in STAGES}
    weights = {s: {n: sha for n, sha in outputs[s].items() if n.startswith("tensor.")} for s in STAGES[1:7]}
    # decode and prefill hold the same weights: the same blobs, at trace, export and edge.
    for kind in ("trace", "export", "edge"):
        assert weights[f"{kind}.decode"] == weights[f"{kind}.prefill"] and weights[f"{kind}.decode"]
    assert weights["export.decode"] == weights["trace.decode"]  # handed on: traced with this build's weights
    # The edge program reuses every export weight (its passes only add two scalar constants).
    export, edge = weights["export.decode"], weights["edge.decode"]
    assert all(edge.get(name) == sha for name, sha in export.items())
    assert len(edge) - len(export) <= 2
    # One weights blob for both methods, stored, and packaged into the .ptd, once; the compile
    # writes none of its own (it proves its constant table on AOTInductor's, in memory).
    assert "weights.blob" not in outputs["compile.decode"]
    assert outputs["blob.decode"]["weights.blob"] == outputs["blob.prefill"]["weights.blob"]
    from cudabuild.engine.store import Store

    store = Store(built_tiny.cache)
    blob = store.objects.read_bytes(outputs["blob.decode"]["weights.blob"])
    # A blob is kept whole or as ranges of the others (cudabuild.engine.spans): either, once.
    blobs = sum(1 for k in store.table.cache.iterkeys() if k.startswith(("blob:", "spans:")))
    store.close()
    distinct = {sha for s in STAGES for sha in outputs[s].values()}
    assert blobs == len(distinct)
    ptd = (built_tiny.root / "build" / "tiny_lm" / "cpu" / "aoti_cpu_blob.ptd").stat().st_size
    assert len(blob) <= ptd < 2 * len(blob)


def noop_imports(project, model: str) -> str:
    """What a no-op `doit export model=MODEL target=cpu` in `project` says it imported."""
    probe = (
        f"import sys, runpy; sys.argv = ['doit', 'export', 'model={model}', 'target=cpu'];\n"
        "from doit.doit_cmd import DoitMain; from doit.cmd_base import ModuleTaskLoader;\n"
        "import dodo; rc = DoitMain(ModuleTaskLoader(dodo)).run(sys.argv[1:]);\n"
        "print('IMPORTED', 'torch' in sys.modules, 'executorch' in sys.modules, rc)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=project.root, env=project.env(),
                            capture_output=True, text=True, timeout=600)
    assert_ok(result)
    return next(line for line in result.stdout.splitlines() if line.startswith("IMPORTED"))


def test_noop_runs_nothing_and_imports_no_torch(tiny_copy):
    """(How fast a no-op is, is bench/incremental.py's figure: a timed assertion here failed on a busy
    machine. What makes it fast is asserted: no torch, no ExecuTorch, nothing run.)"""
    assert noop_imports(tiny_copy, "tiny_lm") == "IMPORTED False False 0"
    assert set(tiny_copy.statuses().values()) == {"cached"}


def test_a_noop_of_a_model_whose_disk_need_is_checked_imports_no_torch(built_qwen_cpu, tmp_path):
    """qwen_moe projects its weights' bytes, so a build checks its disk before its first stage
    (doit_tasks.check_room); a no-op's check decides no more than its stamps."""
    project = built_qwen_cpu.copy(tmp_path)
    assert noop_imports(project, "qwen_moe") == "IMPORTED False False 0"
    assert set(project.statuses("qwen_moe").values()) == {"cached"}


def test_doit_list_lists_and_says_nothing_about_building(tiny_copy):
    listed = tiny_copy.doit("list", "--all", "model=tiny_lm")  # target=auto: the note of what it picks is a build's
    assert listed.returncode == 0 and listed.stderr == ""
    assert "export:compile.decode" in listed.stdout and "building" not in listed.stdout


def test_a_comment_edit_reruns_nothing(tiny_copy):
    recipe = tiny_copy.root / "recipes" / "tiny_lm.py"
    recipe.write_text("# a comment that moves every line\n\n" + recipe.read_text().replace(
        "def decode_inputs(model: TinyLM):", "def decode_inputs(model: TinyLM):  # a comment at a line's end"))
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    assert set(tiny_copy.statuses().values()) == {"cached"}
    recipe.write_text(recipe.read_text().replace("def decode_inputs(model: TinyLM):", "def decode_inputs(model):"))
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    assert tiny_copy.statuses()["export.decode"] == "ran"  # a code edit is not a comment


def test_an_edit_that_changes_no_graph_reruns_trace_and_export_only(tiny_copy):
    recipe = tiny_copy.root / "recipes" / "tiny_lm.py"
    text = recipe.read_text()
    text = text.replace("T = 8\n    return (torch.arange(T,", "length = 8\n    T = length\n    return (torch.arange(T,")
    recipe.write_text(text)
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    statuses = tiny_copy.statuses()
    assert statuses["trace.decode"] == statuses["trace.prefill"] == statuses["export.decode"] == "ran"
    assert {s for k, s in statuses.items() if not k.startswith(("trace", "export"))} == {"cached"}
    reason = next(s for s in tiny_copy.manifest()["stages"] if s["stage"] == "export")["reason"]
    assert "recipes/tiny_lm.py" in reason


def test_one_method_spec_change_reruns_that_method_then_history_hits_both_ways(tiny_copy):
    first = tiny_copy.manifest()["outputs"]
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu", "decode.emulate_precision_casts=OFF"))
    statuses = tiny_copy.statuses()
    ran = {k for k, s in statuses.items() if s == "ran"}
    assert ran == {"compile.decode", "blob.decode", "package", "verify.decode"}, statuses
    compile_row = next(s for s in tiny_copy.manifest()["stages"] if s["stage"] == "compile" and s["method"] == "decode")
    assert "emulate_precision_casts: ON -> OFF" in compile_row["reason"]
    changed = tiny_copy.manifest()["outputs"]

    # Back to the old value: doit alone would rebuild; the store remembers every configuration.
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    assert not {k for k, s in tiny_copy.statuses().items() if s == "ran"}
    assert tiny_copy.manifest()["outputs"] == first
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu", "decode.emulate_precision_casts=OFF"))
    assert not {k for k, s in tiny_copy.statuses().items() if s == "ran"}
    assert tiny_copy.manifest()["outputs"] == changed


def test_restore_after_wiping_build_dir_is_bit_identical(tiny_copy):
    out = tiny_copy.root / "build" / "tiny_lm" / "cpu"
    before = {name: sha(out / name) for name in ("model.pte", "aoti_cpu_blob.ptd")}
    shutil.rmtree(tiny_copy.root / "build")
    for db in tiny_copy.root.glob(".doit.db*"):
        db.unlink()
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    statuses = tiny_copy.statuses()
    assert set(statuses.values()) == {"restored"}, statuses
    assert {name: sha(out / name) for name in before} == before


def test_deleted_output_is_restored_not_rebuilt(tiny_copy):
    out = tiny_copy.root / "build" / "tiny_lm" / "cpu"
    digest = sha(out / "model.pte")
    (out / "model.pte").unlink()
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    assert tiny_copy.statuses()["package"] == "restored"
    assert sha(out / "model.pte") == digest


def recorded_stages(project) -> set:
    from cudabuild.engine.store import Store

    store = Store(project.cache)
    try:
        return {json.loads(store.table.cache.get(k))["stage"] for k in store.table.cache.iterkeys() if k.startswith("rec:")}
    finally:
        store.close()


def _one_line_error(result) -> str:
    assert result.returncode != 0
    lines = [l for l in (result.stderr + result.stdout).splitlines() if l.startswith("cudabuild: error:")]
    assert len(lines) == 1, result.stderr + result.stdout
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["model=no_such_model"], "unknown model 'no_such_model'; known models: "),
        (["model=tiny_lm", "target=tpu"], "unknown target 'tpu'"),
        (["model=tiny_lm", "target=cpu", "max_autotune=maybe"], "invalid value max_autotune=MAYBE"),
        (["model=tiny_lm", "target=cpu", "decode.nonsense=ON"], "unknown setting 'decode.nonsense'"),
        (["model=tiny_lm", "target=cpu", "prefil.max_autotune=ON"], "spec override 'prefil.max_autotune' names unknown method 'prefil'"),
        (["model=tiny_lm", "target=cpu", "triton_kernel_mode=ON"], "triton_kernel_mode=ON needs target=cuda"),
        (["model=tiny_lm", "target=cpu", "seed=abc"], "tiny_lm option seed=abc: expected an integer >= 0 (default 0)"),
        (["tiny_lm", "target=cpu"], "'tiny_lm' is not a task; settings are NAME=VALUE: model=tiny_lm"),
    ],
)
def test_bad_input_is_one_line_and_caches_nothing(project, args, expected):
    result = project.export(*args)
    line = _one_line_error(result)
    assert expected in line
    if "known models" in expected:
        assert "tiny_lm" in line
    assert not project.cache.exists() or not cache_entries(project)


def test_recipe_that_fails_to_export_names_the_method_and_caches_nothing(project):
    broken = project.root / "recipes" / "broken_lm.py"
    # Data-dependent control flow cannot be exported: the prefill method must fail, by name.
    text = broken_recipe_text(project)
    broken.write_text(text)
    result = project.export("model=broken_lm", "target=cpu")
    line = _one_line_error(result)
    assert "method decode of broken_lm failed to export" in line
    # ... and the first line of torch.export's own error, which says what to fix.
    assert "failed to export: GuardOnDataDependentSymNode: Could not guard on data-dependent expression" in line
    assert recorded_stages(project) <= {"probe"}  # the toolchain probe is valid; nothing of the model


def test_recipe_syntax_error_names_file_and_line(project):
    (project.root / "recipes" / "typo.py").write_text("from cudabuild.recipe import Recipe\n\nRECIPE = Recipe(\n")
    line = _one_line_error(project.export("model=typo", "target=cpu"))
    assert "recipes/typo.py:3" in line and "syntax error" in line

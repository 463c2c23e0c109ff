"""cudabuild.engine.explain: the words for a changed input, the first differing graph node, and
`cudabuild explain`'s forecast against a real tiny_lm build (see _fixtures_cli)."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

from _fixtures_cli import BUILD, SPEC_CHANGE, scripted_builds, tiny_lm_build
from cudabuild.backend.toolchain import predict_probe_value
from cudabuild.engine import explain
from cudabuild.engine.explain import Pending, graph_difference
from cudabuild.pipeline import PIPELINE

reason = functools.partial(explain.reason, pipeline=PIPELINE)  # the engine is handed its stage table

EDGE = {"stage": "edge", "version": 1, "target": "cpu", "method": "decode", "graph": "a" * 64,
        "specs": {"triton_kernel_mode": "OFF"}, "toolchain": {"torch": "2.13.0", "triton": "3.6.0"}}


def changed(inputs: dict, **updates) -> dict:
    new = json.loads(json.dumps(inputs))
    for path, value in updates.items():
        *parents, leaf = path.split("__")
        node = new
        for key in parents:
            node = node[key]
        node[leaf] = value
    return new


# -- reason: the words runner.py stores in each stamp -------------------------------------------


def test_reason_names_spec_toolchain_and_upstream_graph():
    compile_inputs = dict(EDGE, stage="compile", specs={"max_autotune": "OFF"})
    assert reason(compile_inputs, changed(compile_inputs, specs__max_autotune="ON")) == "spec max_autotune: OFF -> ON"
    assert reason(EDGE, changed(EDGE, toolchain__triton="3.7.1")) == "toolchain triton: 3.6.0 -> 3.7.1"
    assert reason(EDGE, changed(EDGE, graph="b" * 64)) == "the exported graph of decode changed (aaaaaaaaaaaa -> bbbbbbbbbbbb)"
    assert reason(compile_inputs, changed(compile_inputs, graph="b" * 64)).startswith("the edge graph of decode changed")


def test_reason_names_source_file_option_env_and_package_spec():
    export = {"stage": "export", "sources": {"recipes/tiny_lm.py": "1" * 64, "cudabuild/recipe.py": "2" * 64},
              "options": {"seed": 0}}
    assert reason(export, changed(export, **{"sources__recipes/tiny_lm.py": "3" * 64})) == "source recipes/tiny_lm.py changed"
    assert reason(export, changed(export, options__seed=1)) == "option seed: 0 -> 1"
    probe = {"stage": "probe", "fingerprint": {"env": {}, "packages": {"triton": "3.6.0"}}}
    assert reason(probe, changed(probe, fingerprint__env={"TORCHINDUCTOR_FOO": "1"})) == "toolchain env TORCHINDUCTOR_FOO: unset -> 1"
    assert reason(probe, changed(probe, fingerprint__packages={"triton": "3.7.1"})) == "toolchain triton: 3.6.0 -> 3.7.1"
    package = {"stage": "package", "methods": {"decode": {"specs": {"max_autotune": "OFF"}, "compiled": "c" * 64}}}
    assert reason(package, changed(package, methods__decode__specs={"max_autotune": "ON"})) == "spec decode.max_autotune: OFF -> ON"
    assert reason(package, changed(package, methods__decode__compiled="d" * 64)).startswith("result of blob.decode changed")
    blob = {"stage": "blob", "method": "decode", "weights": "e" * 64, "code": "g" * 64, "compiled": "c" * 64}
    assert reason(blob, changed(blob, weights="f" * 64)) == "the weights of decode changed (eeeeeeeeeeee -> ffffffffffff)"


def test_reason_names_autotune_pins_and_inputs_new_to_cudabuild():
    compile_inputs = dict(EDGE, stage="compile", autotune_pin=None)
    assert reason(compile_inputs, changed(compile_inputs, autotune_pin="p" * 64)) == "pinned autotune decisions for decode added"
    assert reason(EDGE, compile_inputs) == "cudabuild now keys compile on autotune_pin; stage: edge -> compile"


def test_reason_when_nothing_differs_or_nothing_ran():
    assert reason(None, EDGE) == "not built here before, and no cached result"
    assert reason(EDGE, EDGE) == "outputs missing from build/ and from the cache"


# -- graph differences -------------------------------------------------------------------------

NODES = [
    '["placeholder","",[],{},["T","torch.float32",["1","8"],["8","1"],"cpu"]]',
    '["call_function","aten.silu.default",[["%",0]],{},["T","torch.float32",["1","8"],["8","1"],"cpu"]]',
    '["output","output",[[["%",1]]],{},null]',
]


def summary(nodes=NODES, **fields) -> dict:
    return {"nodes": list(nodes), "inputs": [], "outputs": [], "ranges": [], "state": {"w": "1"}, "constants": {}, **fields}


def test_graph_difference_names_the_first_differing_node():
    gelu = NODES[:1] + [NODES[1].replace("silu", "gelu")] + NODES[2:]
    assert graph_difference(summary(), summary(gelu)) == \
        "first difference at node 1: call_function aten.silu.default -> call_function aten.gelu.default"
    wider = NODES[:1] + [NODES[1].replace('["1","8"],["8","1"]', '["1","16"],["16","1"]')] + NODES[2:]
    assert graph_difference(summary(), summary(wider)) == \
        "first difference at node 1: call_function aten.silu.default: value changed (float32[1, 8] -> float32[1, 16])"
    assert graph_difference(summary(), summary(NODES + [NODES[1]])) == \
        "1 node(s) added after node 2, first call_function aten.silu.default"
    assert graph_difference(summary(), summary(state={"w": "2"})) == "same nodes, weight w changed"


def test_probe_prediction_matches_a_real_probe(monkeypatch):
    """explain predicts probe's report from the cheap fingerprint; it must agree with toolchain.probe."""
    from cudabuild.backend.toolchain import cheap_fingerprint, probe

    last_value, last_fingerprint = probe("cpu"), cheap_fingerprint("cpu")
    monkeypatch.setenv("TORCHINDUCTOR_FOO", "1")
    assert predict_probe_value(last_value, last_fingerprint, cheap_fingerprint("cpu")) == probe("cpu")
    # Without a last report, what probe measures itself (torch, compiler) is not predicted.
    assert isinstance(predict_probe_value(None, None, cheap_fingerprint("cpu"))["compiler"], Pending)


# -- cudabuild explain on a real build -----------------------------------------------------------


@pytest.mark.slow
def test_up_to_date_build_explains_without_torch(tmp_path_factory):
    """What keeps explain quick is asserted (no torch, no ExecuTorch); how quick is not: a time
    asserted here failed on a busy machine."""
    built = tiny_lm_build(tmp_path_factory)
    assert set(built.explain().values()) == {"up to date"}
    code = ("import sys; from cudabuild.cli import main; "
            f"rc = main(['explain', *{list(BUILD)!r}]); "
            "print(rc, 'torch' in sys.modules, 'executorch' in sys.modules, file=sys.stderr)")
    rc, torch_loaded, executorch_loaded = built.run("-c", code).stderr.split()[-3:]
    assert (rc, torch_loaded, executorch_loaded) == ("0", "False", "False")


@pytest.mark.slow
def test_spec_override_names_the_spec_on_that_method_only(tmp_path_factory):
    said = tiny_lm_build(tmp_path_factory).explain("decode.max_autotune=ON")
    assert said["compile.decode"] == "will run because spec max_autotune: OFF -> ON"
    assert said["compile.prefill"] == "up to date"
    assert said["package"].startswith("will run because spec decode.max_autotune: OFF -> ON")
    assert said["blob.decode"] == "will run if compile.decode changes its result (early cutoff may stop it)"
    assert said["verify.decode"] == "will run if blob.decode changes its result (early cutoff may stop it)"
    assert {said[s] for s in ("probe", "export.decode", "edge.decode", "verify.prefill")} == {"up to date"}


@pytest.mark.slow
def test_toolchain_env_change_names_the_variable(tmp_path_factory):
    said = tiny_lm_build(tmp_path_factory).explain(TORCHINDUCTOR_FOO="1")
    assert said["probe"] == "will run because toolchain env TORCHINDUCTOR_FOO: unset -> 1"
    assert said["compile.decode"] == said["compile.prefill"] == "will run because toolchain env TORCHINDUCTOR_FOO: unset -> 1"
    assert said["export.decode"] == said["edge.decode"] == "up to date"  # they key on torch/triton/executorch only
    assert said["package"] == "will run if blob.decode or blob.prefill changes its result (early cutoff may stop it)"


@pytest.mark.slow
def test_wiped_build_is_restorable_from_cache(tmp_path_factory, tmp_path):
    clone = tiny_lm_build(tmp_path_factory).copy(tmp_path)
    shutil.rmtree(clone.root / "build")
    said = clone.explain()
    assert len(said) == 14 and all(words.startswith("restorable from cache") for words in said.values()), said


@pytest.mark.slow
def test_graph_change_names_the_first_differing_node_and_the_source(tmp_path_factory, tmp_path):
    clone = tiny_lm_build(tmp_path_factory).copy(tmp_path)
    model = clone.root / "cudabuild" / "models" / "tiny_lm.py"
    model.write_text(model.read_text().replace("F.silu(", "F.gelu("))
    clone.run("-m", "doit", "export:export.decode", *BUILD)  # trace and export run for decode only; edge has not seen it yet
    said = clone.explain()
    assert said["trace.decode"] == said["export.decode"] == "up to date"
    assert said["edge.decode"].startswith("will run because the exported graph of decode changed: first difference at node ")
    assert said["edge.decode"].endswith(": call_function aten.silu.default -> call_function aten.gelu.default")
    assert said["trace.prefill"] == "will run because source cudabuild/models/tiny_lm.py changed"
    assert said["export.prefill"] == ("will run because source cudabuild/models/tiny_lm.py changed (or restore, "
                                      "depending on trace.prefill's result)")
    assert said["edge.prefill"] == "will run if export.prefill changes its code (early cutoff may stop it)"


@pytest.mark.slow
def test_manifest_records_why_each_stage_ran(tmp_path_factory):
    from cudabuild.engine.store import Store

    scripted = scripted_builds(tmp_path_factory)
    store = Store(scripted.cache)
    try:
        spec_build = store.actions.build_log()[-2]  # no-op, spec change, rebuild after rm -rf build
    finally:
        store.close()
    reasons = {f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]: s.get("reason")
               for s in spec_build["stages"] if s["status"] == "ran"}
    key, value = SPEC_CHANGE.split("=")
    assert reasons["compile.decode"] == f"spec {key.split('.')[1]}: ON -> {value}"
    assert reasons["blob.decode"].startswith("result of compile.decode changed")
    assert reasons["package"].startswith("result of blob.decode changed")


@pytest.mark.slow
def test_an_empty_cache_beside_a_current_build_dir_is_said_by_explain_and_the_build(tmp_path_factory, tmp_path):
    clone = tiny_lm_build(tmp_path_factory).copy(tmp_path)
    shutil.rmtree(clone.cache)  # emptied, as another CUDABUILD_CACHE_DIR would be
    lines = clone.cudabuild("explain", *BUILD).stdout.splitlines()
    assert all(line.split(None, 1)[1] == "up to date" for line in lines[1:-1])
    note = ("build/tiny_lm/cpu/ is up to date, and the cache holds none of its stages (emptied, or another "
            "CUDABUILD_CACHE_DIR): a change rebuilds them from scratch")
    assert lines[-1] == note
    built = clone.run("-m", "doit", "export", *BUILD).stdout
    assert f"  {note}" in built.splitlines() and "the cache saved" not in built

"""The build graph as a table (cudabuild.engine.graph, cudabuild.pipeline): the plan, dependencies,
key inputs and upstream names all come from the rows, so a new stage kind is one row."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cudabuild.engine.graph import Pending, Pipeline, Result, Stage, StageKind, pending_in
from cudabuild.engine.hashing import digest
from cudabuild.pipeline import PIPELINE

CONFIG = SimpleNamespace(model="tiny_lm", target="cpu", methods=("decode", "prefill"), project=Path("/nonexistent"),
                         options={}, specs={"decode": {"max_autotune": "OFF"}, "prefill": {"max_autotune": "OFF"}},
                         description={"sources": {"recipes/tiny_lm.py": "s"}, "tolerances": {"atol": 1e-3}},
                         checkpoint=None)


def _read(results: dict):
    return lambda stage: results.get(stage.id)


def test_the_plan_and_dependencies_follow_the_table():
    assert [s.id for s in PIPELINE.plan(CONFIG)] == [
        "probe", "trace.decode", "trace.prefill", "export.decode", "export.prefill", "edge.decode", "edge.prefill",
        "compile.decode", "compile.prefill", "blob.decode", "blob.prefill", "package", "verify.decode", "verify.prefill"]
    deps = lambda stage: [d.id for d in PIPELINE.dependencies(stage, CONFIG)]
    assert deps(Stage("probe")) == []
    assert deps(Stage("export", "prefill")) == ["probe", "trace.prefill"]
    assert deps(Stage("compile", "prefill")) == ["probe", "edge.prefill"]
    assert deps(Stage("blob", "prefill")) == ["probe", "export.prefill", "edge.prefill", "compile.prefill"]
    assert deps(Stage("package")) == ["probe", "export.decode", "export.prefill", "blob.decode", "blob.prefill"]
    assert deps(Stage("verify", "decode")) == ["probe", "export.decode", "edge.decode", "blob.decode", "package"]
    assert [PIPELINE.final_outputs(s) for s in (Stage("compile", "decode"), Stage("package"))] == [False, True]


def test_on_a_device_the_eager_reference_is_a_stage_beside_edge_and_compile():
    cuda = SimpleNamespace(**dict(vars(CONFIG), target="cuda"))
    plan = [s.id for s in PIPELINE.plan(cuda)]
    # After the compiles and the package in the plan (a free worker takes it once nothing on the
    # way to the package waits), and before the verifies that read it.
    assert plan[plan.index("compile.prefill") + 1:plan.index("verify.decode")] == [
        "blob.decode", "blob.prefill", "package", "reference.decode", "reference.prefill"]
    deps = lambda stage, config: [d.id for d in PIPELINE.dependencies(stage, config)]
    assert deps(Stage("reference", "decode"), cuda) == ["probe", "export.decode"]
    assert deps(Stage("verify", "decode"), cuda)[-1] == "reference.decode"
    # Its key is the export's result: an edge or compile change leaves it as it was, and verify
    # keys on what it computed.
    results = {"probe": Result("p", {"torch": "2.11"}), "export.decode": Result("e1"), "edge.decode": Result("g1"),
               "compile.decode": Result("c1"), "blob.decode": Result("b1"), "reference.decode": Result("r1")}
    key = lambda stage, res: digest(PIPELINE.inputs(stage, cuda, _read(res), lambda: {}, lambda: None))
    recompiled = dict(results, **{"edge.decode": Result("g2"), "compile.decode": Result("c2"), "blob.decode": Result("b2")})
    assert key(Stage("reference", "decode"), recompiled) == key(Stage("reference", "decode"), results)
    assert key(Stage("reference", "decode"), dict(results, **{"export.decode": Result("e2")})) != key(
        Stage("reference", "decode"), results)
    verify_in = PIPELINE.inputs(Stage("verify", "decode"), cuda, _read(results), lambda: {}, lambda: None)
    assert PIPELINE.upstream_of(("reference",), verify_in) == "reference.decode"
    # On the CPU the reference is verify's own first step: no such stage, and verify's key as it was.
    assert "reference" not in PIPELINE.inputs(Stage("verify", "decode"), CONFIG, _read(results), lambda: {}, lambda: None)


def test_upstream_digests_enter_the_key_and_are_named_back():
    results = {"probe": Result("p", {"torch": "2.13"}), "export.decode": Result("e1"), "export.prefill": Result("e2"),
               "edge.decode": Result("g1"), "compile.decode": Result("c1"), "compile.prefill": Result("c2"),
               "blob.decode": Result("b1"), "blob.prefill": Result("b2")}
    compile_in = PIPELINE.inputs(Stage("compile", "decode"), CONFIG, _read(results), lambda: {}, lambda: None)
    assert compile_in["graph"] == "g1" and compile_in["version"] == PIPELINE.rows["compile"].version
    assert PIPELINE.upstream_of(("graph",), compile_in) == "edge.decode"
    package_in = PIPELINE.inputs(Stage("package"), CONFIG, _read(results), lambda: {}, lambda: None)
    # Upstream digests and the row's own params merge under methods.<m>.
    assert package_in["methods"]["prefill"] == {"graph": "e2", "compiled": "b2", "specs": {"max_autotune": "OFF"}}
    assert PIPELINE.upstream_of(("methods", "prefill", "compiled"), package_in) == "blob.prefill"
    assert PIPELINE.upstream_of(("methods", "prefill", "specs"), package_in) is None
    # A different upstream result is a different key downstream (and only there).
    changed = dict(results, **{"edge.decode": Result("g1-new")})
    again = lambda stage, res: digest(PIPELINE.inputs(stage, CONFIG, _read(res), lambda: {}, lambda: None))
    assert again(Stage("compile", "decode"), changed) != again(Stage("compile", "decode"), results)
    assert again(Stage("compile", "prefill"), changed) == again(Stage("compile", "prefill"), results)


def test_edge_and_compile_follow_the_exported_code_and_the_blob_its_weights():
    """Export's result carries its code digest as a facet: edge keys on that, so new weights of the
    same code (another content digest) keep edge's and compile's keys; the blob keys on the weights."""
    code = {"facets": {"code": "k1"}}
    results = {"probe": Result("p", {"torch": "2.13"}), "export.decode": Result("e1", code),
               "edge.decode": Result("g1"), "compile.decode": Result("c1")}
    key = lambda stage, res: digest(PIPELINE.inputs(stage, CONFIG, _read(res), lambda: {}, lambda: None))
    new_weights = dict(results, **{"export.decode": Result("e2", code)})
    assert key(Stage("edge", "decode"), new_weights) == key(Stage("edge", "decode"), results)
    assert key(Stage("blob", "decode"), new_weights) != key(Stage("blob", "decode"), results)
    new_code = dict(results, **{"export.decode": Result("e1", {"facets": {"code": "k2"}})})
    assert key(Stage("edge", "decode"), new_code) != key(Stage("edge", "decode"), results)
    edge_in = PIPELINE.inputs(Stage("edge", "decode"), CONFIG, _read(results), lambda: {}, lambda: None)
    assert edge_in["graph"] == "k1" and PIPELINE.upstream_of(("graph",), edge_in) == "export.decode"
    assert PIPELINE.facet_read(("graph",), edge_in) == "code"
    # An upstream that will run has no facets yet: the facet is pending on it.
    pending = dict(results, **{"export.decode": Result(Pending("export.decode"))})
    assert pending_in(PIPELINE.inputs(Stage("edge", "decode"), CONFIG, _read(pending), lambda: {}, lambda: None)) == {
        "export.decode"}


def test_a_pending_upstream_shows_in_the_inputs():
    results = {"probe": Result("p", {"torch": "2.13"}), "export.decode": Result(Pending("export.decode"))}
    inputs = PIPELINE.inputs(Stage("edge", "decode"), CONFIG, _read(results), lambda: {}, lambda: None)
    assert pending_in(inputs) == {"export.decode"}


def test_a_new_stage_kind_is_one_row():
    rows = list(PIPELINE.rows.values()) + [StageKind(
        "size_report", version=1, per_method=False, module="cudabuild.backend.stages.size_report",
        consumes=("package",), results={"packaged": "package"}, params=lambda ctx: {"limit": 10})]
    grown = Pipeline(rows, fingerprint=PIPELINE.cheap_fingerprint)
    assert grown.plan(CONFIG)[-1] == Stage("size_report")
    assert [d.id for d in grown.dependencies(Stage("size_report"), CONFIG)] == ["package"]
    inputs = grown.inputs(Stage("size_report"), CONFIG, _read({"package": Result("pk")}), lambda: {}, lambda: None)
    assert inputs == {"stage": "size_report", "version": 1, "target": "cpu", "packaged": "pk", "limit": 10}
    assert grown.upstream_of(("packaged",), inputs) == "package"


def test_a_row_that_consumes_a_later_or_unknown_kind_is_refused():
    probe = PIPELINE.rows["probe"]
    with pytest.raises(ValueError, match="consumes export"):
        Pipeline([StageKind("early", 1, False, "m", consumes=("export[m]",)), probe], fingerprint=dict)
    per_method = StageKind("lint", 1, True, "m", consumes=("probe",))
    with pytest.raises(ValueError, match=r"use kind\[m\] for the same method's stage"):
        Pipeline([probe, per_method, StageKind("sum", 1, True, "m", consumes=("lint",))], fingerprint=dict)
    with pytest.raises(ValueError, match="keys graph on lint\\[m\\], which it does not consume"):
        Pipeline([probe, per_method, StageKind("sum", 1, True, "m", consumes=("probe",), results={"graph": "lint[m]"})],
                 fingerprint=dict)


SEEDED = SimpleNamespace(**dict(vars(CONFIG), options={"seed": 0, "layers": 2},
                                description=dict(CONFIG.description, weights_options=("seed",))))


def _with(config, **options):
    return SimpleNamespace(**dict(vars(config), options=dict(config.options, **options)))


def test_the_trace_follows_the_code_and_export_the_weights_too():
    """Trace's key leaves out the options that change only the weights' values (a seed), so a new
    seed finds it; export keys on them and on the traced code (trace's `code` facet)."""
    results = {"probe": Result("p", {"torch": "2.13"}), "trace.decode": Result("t1", {"facets": {"code": "k1"}})}
    key = lambda stage, config: digest(PIPELINE.inputs(stage, config, _read(results), lambda: {}, lambda: None))
    trace, export = Stage("trace", "decode"), Stage("export", "decode")
    assert key(trace, _with(SEEDED, seed=7)) == key(trace, SEEDED)
    assert key(trace, _with(SEEDED, layers=3)) != key(trace, SEEDED)  # other code: another trace
    assert key(export, _with(SEEDED, seed=7)) != key(export, SEEDED)
    export_in = PIPELINE.inputs(export, SEEDED, _read(results), lambda: {}, lambda: None)
    assert export_in["graph"] == "k1" and PIPELINE.upstream_of(("graph",), export_in) == "trace.decode"
    assert ("options", "seed") in PIPELINE.rows["export"].values_only(SEEDED)


def test_a_result_without_the_facet_a_stage_reads_keys_it_whole():
    """On cuda the trace keys on the quantize stage's `layout` facet; a quantize record made before
    the facet existed has none, and is then read whole (its digest), never as nothing."""
    cuda = SimpleNamespace(**dict(vars(SEEDED), target="cuda",
                                  description=dict(SEEDED.description, quantize={"options": [], "folders": [], "sources": []})))
    inputs = lambda quantize: PIPELINE.inputs(Stage("trace", "decode"), cuda, _read(
        {"probe": Result("p", {"torch": "2.13"}), "quantize": quantize}), lambda: {}, lambda: None)
    assert inputs(Result("q1", {"facets": {"layout": "L"}}))["weights"] == "L"
    assert inputs(Result("q2", {"facets": {"layout": "L"}}))["weights"] == "L"  # new weights, one layout
    assert inputs(Result("q1", {"device": "cuda"}))["weights"] == "q1"
    assert isinstance(inputs(Result(Pending("quantize")))["weights"], Pending)

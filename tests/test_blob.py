"""New weights, same model (cudabuild.backend.stages.blob), on real tiny_lm builds for the CPU: another
seed lowers and compiles nothing and writes a weights blob byte-identical to a cold build's, and
verify passes on it; a shape change compiles; a damaged or mismatched constant table refuses the
shortcut with one line, compiles, and still gives a cold build's bytes."""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import Project, assert_ok

from cudabuild.engine.store import Store

BUILD = ("model=tiny_lm", "target=cpu")
OUTPUTS = ("model.pte", "aoti_cpu_blob.ptd")

pytestmark = pytest.mark.slow


def outputs(project: Project) -> dict[str, str]:
    return {name: hashlib.sha256((project.build_dir / name).read_bytes()).hexdigest() for name in OUTPUTS}


def notes(project: Project) -> dict[str, str]:
    return {f"{s['stage']}.{s['method']}": s.get("note") for s in project.manifest()["stages"] if s["stage"] == "blob"}


def test_a_new_seed_compiles_nothing_and_gives_a_cold_builds_bytes(tiny_copy, cold_seed_1):
    said = tiny_copy.explain("seed=1")
    assert said["export.decode"] == "will run for the new weights (option seed: 0 -> 1): binds them into the traced program"
    assert said["edge.decode"] == said["compile.prefill"] == (
        "up to date (its code is unchanged: only the weights change, option seed: 0 -> 1)")
    assert said["blob.decode"] == said["package"] == "will run for the new weights (option seed: 0 -> 1)"

    result = tiny_copy.export(*BUILD, "seed=1")
    assert_ok(result)
    statuses = tiny_copy.statuses()
    assert {statuses[f"{kind}.{m}"] for kind in ("edge", "compile") for m in ("decode", "prefill")} == {"cached"}
    assert statuses["blob.decode"] == statuses["blob.prefill"] == statuses["package"] == "ran"
    assert notes(tiny_copy) == {"blob.decode": "weights blob rewritten, code as compiled",
                                "blob.prefill": "weights blob rewritten, code as compiled"}
    assert "weights blob rewritten, code as compiled" in result.stdout  # the summary says it
    reasons = {f"{s['stage']}.{s['method']}": s.get("reason") for s in tiny_copy.manifest()["stages"]}
    assert reasons["blob.decode"].startswith("the weights of decode changed")
    verify = tiny_copy.manifest()["verify"]
    assert verify["decode"]["passed"] and verify["prefill"]["passed"]
    assert outputs(tiny_copy) == outputs(cold_seed_1)
    # The cold build of seed 1 compiled the code seed 0 had: the same keys.
    assert tiny_copy.stamp("compile.decode")["key"] == cold_seed_1.stamp("compile.decode")["key"]
    assert cold_seed_1.stamp("blob.decode")["value"]["blob"] == "as compiled"


def test_another_shape_compiles(tiny_copy):
    said = tiny_copy.explain("layers=1")
    assert said["edge.decode"] == "will run if export.decode changes its code (early cutoff may stop it)"
    assert said["compile.decode"] == "will run if edge.decode changes its result (early cutoff may stop it)"
    assert_ok(tiny_copy.export(*BUILD, "layers=1"))
    statuses = tiny_copy.statuses()
    assert statuses["edge.decode"] == statuses["compile.decode"] == statuses["compile.prefill"] == "ran"
    assert tiny_copy.stamp("blob.decode")["value"]["blob"] == "as compiled"
    assert tiny_copy.manifest()["verify"]["decode"]["passed"]


def _damage_table(project: Project, method: str, damage) -> None:
    """Give compile.<method>'s record and stamp another constants.json: damage(table) -> bytes."""
    path = project.build_dir / ".stamps" / f"compile.{method}.json"
    stamp = json.loads(path.read_text())
    store = Store(project.cache)
    try:
        table = json.loads(store.objects.read_bytes(stamp["outputs"]["constants.json"]))
        sha = store.objects.put_bytes(damage(table))
        record = store.actions.lookup(stamp["key"], take=True)[0]
        record["outputs"]["constants.json"] = stamp["outputs"]["constants.json"] = sha
        store.actions.put_record(stamp["key"], record)
    finally:
        store.close()
    path.write_text(json.dumps(stamp))


def _swap_first_stride(table) -> bytes:
    table["constants"][0]["stride"] = list(reversed(table["constants"][0]["stride"]))
    return json.dumps(table).encode()


def test_a_damaged_or_mismatched_constant_table_refuses_the_shortcut_and_compiles(tiny_copy, cold_seed_1):
    _damage_table(tiny_copy, "decode", _swap_first_stride)  # a table that does not fit the program
    _damage_table(tiny_copy, "prefill", lambda table: b'{"version": 1, "constants": [')  # cut short
    result = tiny_copy.export(*BUILD, "seed=1")
    assert_ok(result)
    said = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("blob.") and ": " in line]
    assert sorted(said) == [  # the two methods' blob stages run side by side, in either order
        "blob.decode: constant embed.weight has stride [64, 1] in the program, [1, 64] in the .so; "
        "compiling for these weights",
        "blob.prefill: compile.prefill: its constant table is not JSON (Expecting value: line 1 column 30 (char 29)); "
        "compiling for these weights"]
    assert set(notes(tiny_copy).values()) == {"compiled for these weights: the shortcut was refused"}
    assert tiny_copy.statuses()["compile.decode"] == "cached"
    assert tiny_copy.manifest()["verify"]["prefill"]["passed"]
    assert outputs(tiny_copy) == outputs(cold_seed_1)  # compiled where the compile stage compiles


def test_a_constant_table_that_is_not_the_sos_own_refuses_the_shortcut(tiny_copy):
    def renamed(table):
        table["constants"][1]["name"] = "not_the_sos"
        return json.dumps(table).encode()

    _damage_table(tiny_copy, "decode", renamed)
    result = tiny_copy.doit("export:blob.decode", *BUILD, "seed=2")  # that stage and what it needs
    assert_ok(result)
    line = next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("blob.decode:"))
    assert line.startswith("blob.decode: compile.decode's constant table is not its .so's: the .so's constant ")
    assert line.endswith("; compiling for these weights")


def test_an_edge_lowering_that_read_the_weights_is_lowered_again_for_new_ones(tiny_copy, cold_seed_1):
    """Edge keys on the exported code because its lowering reads no weight (checked each run); one
    that did says so in its value, and the blob stage lowers and compiles again for other weights."""
    path = tiny_copy.build_dir / ".stamps" / "edge.decode.json"
    stamp = json.loads(path.read_text())
    stamp["value"]["weights_read"] = {"count": 1, "first": ["aten.mul.Tensor on embed.weight"]}
    path.write_text(json.dumps(stamp))
    result = tiny_copy.doit("export:blob.decode", *BUILD, "seed=1")  # that stage and what it needs
    assert_ok(result)
    line = next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("blob.decode:"))
    assert line == ("blob.decode: edge.decode read the weights' values while lowering (aten.mul.Tensor on embed.weight), "
                    "so its program holds values of other weights; compiling for these weights")
    blob = tiny_copy.stamp("blob.decode")
    assert blob["value"]["blob"] == "compiled"
    assert blob["outputs"] == cold_seed_1.stamp("blob.decode")["outputs"]  # a cold build's .so and blob

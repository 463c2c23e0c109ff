"""verify is the gate that keeps a wrong compile out of the cache: a mismatch must fail the build
with one line that says where the fault arose, cache nothing, and leave its numbers behind; the
fault locator must tell a weights blob that loads wrong values from compiled code that is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

from _faults import MODEL, TARGET, build_dir, one_error_line, stamp
from conftest import assert_ok

from cudabuild.backend.programs import load_program
from cudabuild.backend import aoti_constants
from cudabuild.backend.stages.reference import compute_dtype
from cudabuild.backend.programs import program_tensors
from cudabuild.backend.stages.verify import constants_unlike_program, promote_libtorch
from cudabuild.engine.store import Store


def edge_program_and_compile(project, tmp_path, method: str = "decode"):
    """(edge program, .so path, weights blob path) of one method, read from the project's cache."""
    store = Store(project.cache)
    try:
        edge_outputs = stamp(project, f"edge.{method}")["outputs"]
        edge = load_program(lambda name: store.objects.read_bytes(edge_outputs[name]))
        compiled = stamp(project, f"blob.{method}")["outputs"]  # the .so, and the blob the build keeps
        so = store.objects.fetch(compiled["model.so"], tmp_path / "model.so")
        blob = store.objects.fetch(compiled["weights.blob"], tmp_path / "weights.blob")
    finally:
        store.close()
    return edge, str(so), str(blob)


def verify_records(project) -> set[str]:
    store = Store(project.cache)
    try:
        return {key for key, record in store.actions.records() if record["stage"].startswith("verify")}
    finally:
        store.close()


def test_the_constants_a_sound_blob_loads_are_the_edge_programs(built_tiny, tmp_path):
    edge, so, blob = edge_program_and_compile(built_tiny, tmp_path)
    compared, unlike = constants_unlike_program(so, blob, edge, "cpu")
    # tiny_lm's 21 weights and both layers' k/v caches (initial zeros); inductor folds the lifted
    # scalar constants into the code, so those have no blob entry.
    assert compared == 25 and unlike == []


def test_a_weights_blob_with_one_wrong_value_is_named_by_its_constant(built_tiny, tmp_path):
    edge, so, blob = edge_program_and_compile(built_tiny, tmp_path)
    data = bytearray(open(blob, "rb").read())
    weight = edge.state_dict["lm_head.weight"].detach().contiguous().numpy().tobytes()
    at = bytes(data).find(weight)
    assert at >= 0, "the blob holds each weight's bytes as they are"
    data[at + 401] ^= 0x40  # an exponent bit of one float in the middle of lm_head.weight
    damaged = tmp_path / "damaged.blob"
    damaged.write_bytes(data)
    assert constants_unlike_program(so, str(damaged), edge, "cpu")[1] == ["lm_head.weight"]


def test_the_blob_check_that_lets_verify_map_the_weights_holds_for_a_sound_blob_only(built_tiny, tmp_path):
    """verify runs the .so on the edge program's mapped weights (no second copy) only after
    check_blob has found the weights blob to hold exactly their bytes at the .so's offsets."""
    edge, so, blob = edge_program_and_compile(built_tiny, tmp_path)
    promote_libtorch("cpu")
    table = aoti_constants.constants_table(so)
    assert len(table) == 25 and not any(c.folded for c in table)
    tensors = program_tensors(edge)
    assert aoti_constants.check_blob(Path(blob), table, tensors) is None
    data = bytearray(open(blob, "rb").read())
    at = bytes(data).find(edge.state_dict["lm_head.weight"].detach().contiguous().numpy().tobytes())
    data[at + 401] ^= 0x40
    damaged = tmp_path / "damaged.blob"
    damaged.write_bytes(data)
    assert aoti_constants.check_blob(damaged, table, tensors) == "the weights blob's bytes for lm_head.weight differ from the program's"
    damaged.write_bytes(data[:-64])
    assert "the weights blob is" in aoti_constants.check_blob(damaged, table, tensors)
    assert "has no tensor in the program" in aoti_constants.check_blob(Path(blob), table, {})


def test_a_bf16_models_float32_logits_are_held_to_bf16s_tolerance():
    import torch

    class Bf16(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, dtype=torch.bfloat16)

        def forward(self, x):
            return self.lin(x).float()

    ep = torch.export.export(Bf16(), (torch.ones(1, 4, dtype=torch.bfloat16),))
    assert compute_dtype(ep, [torch.zeros(1, 4)]) == torch.bfloat16
    fp32 = torch.export.export(torch.nn.Linear(4, 4), (torch.ones(1, 4),))
    assert compute_dtype(fp32, [torch.zeros(1, 4)]) == torch.float32


def test_a_mismatch_fails_the_build_with_its_location_and_caches_nothing(tiny_copy):
    # 21 weights and 4 k/v caches are compared. A tolerance no fp32 compile meets (CPU AOTI differs from eager by ~1e-6) makes a real mismatch.
    recipe = tiny_copy.root / "recipes" / f"{MODEL}.py"
    source = recipe.read_text()
    recipe.write_text(source.replace("    constant_methods=metadata,\n)", "    constant_methods=metadata,\n    tolerances={'float32': 1e-12},\n)"))
    assert recipe.read_text() != source
    before = (stamp(tiny_copy, "verify.decode"), verify_records(tiny_copy))

    result = tiny_copy.export(f"model={MODEL}", f"target={TARGET}")
    line = one_error_line(result)
    # Both methods fail; the line is the first to end (the ready queue's order decides which runs first).
    method = "decode" if "[verify.decode]" in line else "prefill"
    assert f"[verify.{method}] method {method}: compiled output 0 differs from eager by" in line, line
    assert re.search(r"\(allowed \d\.\d+e-1[12]\)", line), line
    assert "and the weights blob loads all 25 constants exactly: the fault is in the compiled code" in line, line
    assert (stamp(tiny_copy, "verify.decode"), verify_records(tiny_copy)) == before  # nothing new stored
    report = json.loads((build_dir(tiny_copy) / f"verify-{method}.failed.json").read_text())
    assert report["passed"] is False and report["constants"] == {"compared": 25, "unlike_edge_program": []}
    assert report["outputs"][0]["max_abs_diff"] > 1e-12

    # Back to the recipe's tolerances: verify is served from the cache and the stale report goes.
    recipe.write_text(source)
    assert_ok(tiny_copy.export(f"model={MODEL}", f"target={TARGET}"))
    assert tiny_copy.statuses()["verify.decode"] == "cached"
    assert not (build_dir(tiny_copy) / f"verify-{method}.failed.json").exists()

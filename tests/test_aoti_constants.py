"""cudabuild.backend.aoti_constants: a compile's constant table, what it says of a weights blob, and
the blob it writes for other weights. The real tables come from real compiles (tests/test_blob.py);
here the table's own rules: AOTInductor's layout, what refuses it, and the blob for other weights
against AOTInductor's own."""

from __future__ import annotations

import torch

from cudabuild.backend import aoti_constants
from cudabuild.backend.aoti_constants import Constant


def table_for(tensors: dict, alignment: int = 64) -> dict:
    """A table as table_of_graph writes one, for these tensors in this order."""
    rows, offset = [], 0
    for i, (fqn, t) in enumerate(tensors.items()):
        nbytes = t.untyped_storage().nbytes()
        rows.append({"name": f"c{i}", "fqn": fqn, "offset": offset, "nbytes": nbytes,
                     "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride()),
                     "storage_offset": t.storage_offset(), "device": "cpu"})
        offset += nbytes if alignment == 1 else -(-nbytes // alignment) * alignment
    return {"version": aoti_constants.TABLE_VERSION, "alignment": alignment, "size": offset, "constants": rows,
            "folded": [], "unsupported": []}


def tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(40, generator=g)
    # An odd size (padding follows it), a view into a bigger storage (the whole storage is written).
    return {"a": torch.randn(3, 5, generator=g), "view": base[8:24].view(4, 4), "b": torch.randn(16, generator=g)}


def test_the_blob_is_each_whole_storage_at_its_aligned_offset(tmp_path):
    weights = tensors(0)
    table = table_for(weights)
    assert [r["offset"] for r in table["constants"]] == [0, 64, 64 + 192] and table["size"] == 64 + 192 + 64
    blob = tmp_path / "weights.blob"
    aoti_constants.write_blob(blob, table, weights)
    data = blob.read_bytes()
    assert data[:60] == weights["a"].numpy().tobytes() and data[60:64] == b"\0" * 4
    assert data[64:64 + 160] == weights["view"]._base.numpy().tobytes()  # its storage from the start
    assert aoti_constants.blob_problem(blob, table, weights) is None
    packed = table_for(weights, alignment=1)  # every constant on the GPU: packed
    aoti_constants.write_blob(blob, packed, weights)
    assert blob.stat().st_size == 60 + 160 + 64 and aoti_constants.blob_problem(blob, packed, weights) is None


def test_a_blob_of_other_bytes_is_named_and_other_weights_of_the_same_shapes_fit(tmp_path):
    table, blob = table_for(tensors(0)), tmp_path / "weights.blob"
    aoti_constants.write_blob(blob, table, tensors(0))
    assert aoti_constants.blob_problem(blob, table, tensors(1)) == "the weights blob's bytes for a differ from the program's"
    assert aoti_constants.fit_problem(table, tensors(1)) is None
    data = bytearray(blob.read_bytes())
    data[62] = 1  # in the padding after a
    blob.write_bytes(data)
    assert aoti_constants.blob_problem(blob, table, tensors(0)) == "the weights blob holds other bytes than zeros before view"


def test_a_table_that_does_not_fit_or_is_not_well_formed_says_why():
    table = table_for(tensors(0))
    other = dict(tensors(0), b=torch.randn(8))
    assert aoti_constants.fit_problem(table, other) == "constant b has shape [8] in the program, [16] in the .so"
    assert aoti_constants.fit_problem(table, {"a": tensors(0)["a"]}).startswith("constant c1 has no tensor 'view'")
    assert aoti_constants.fit_problem(table, dict(tensors(0), a=tensors(0)["a"].t())).startswith("constant a has shape")
    assert aoti_constants.read_table(b"{not json").startswith("its constant table is not JSON")
    moved = dict(table, constants=[dict(table["constants"][0], offset=8)] + table["constants"][1:])
    assert aoti_constants.table_problem(moved) == "its constant table places c0 at 8, not 0"
    assert "folds constants" in aoti_constants.table_problem(dict(table, folded=["c9"]))
    assert aoti_constants.table_problem(dict(table, version=0)) == "its constant table is not of version 1"


def test_the_so_table_must_be_the_tables_own():
    table = table_for(tensors(0))
    own = [Constant(r["name"], r["fqn"], -(-r["nbytes"] // 64) * 64, False) for r in table["constants"]]
    assert aoti_constants.so_table_problem(table, own) is None
    swapped = [own[1], own[0], own[2]]
    assert aoti_constants.so_table_problem(table, swapped).startswith("the .so's constant c1 (view, 192 bytes) is c0")
    assert aoti_constants.so_table_problem(table, own[:2]) == "the .so has 2 constants, its constant table 3"


def test_a_weight_that_is_no_constant_of_the_so_refuses_the_table(tmp_path):
    """A program tensor of more than one element missing from the table may be written into the
    code (inductor inlines small 1-D constants): new values of it would never reach the .so."""
    weights = tensors(0)
    table = table_for({k: v for k, v in weights.items() if k != "b"})
    blob = tmp_path / "weights.blob"
    aoti_constants.write_blob(blob, table, weights)
    assert aoti_constants.blob_problem(blob, table, weights) == \
        "the program's tensor b is no constant of the .so: its values may be in the code"
    # A one-element tensor is keyed by its value in the code digest: it may be written into the code.
    kept = {k: v for k, v in weights.items() if k != "b"}
    assert aoti_constants.blob_problem(blob, table, dict(kept, lifted=torch.tensor([3.0]))) is None

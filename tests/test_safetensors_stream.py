"""cudabuild/formats/safetensors_stream.py: a .safetensors file written tensor by tensor, read back by
the `safetensors` package as the file its own writer makes would be."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from cudabuild.formats.safetensors_stream import SafetensorsStream


def _read(path):
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


def test_tensors_added_in_batches_read_back_with_their_dtypes_shapes_and_metadata(tmp_path):
    first = {"a.int8": torch.arange(-3, 4, dtype=torch.int8), "a.bf16": torch.randn(3, 5).to(torch.bfloat16)}
    second = {"b.f32": torch.randn(2, 2, 2), "b.scalar": torch.tensor(7, dtype=torch.int64),
              "b.empty": torch.zeros(0, 4), "b.strided": torch.randn(4, 6).t()}
    with SafetensorsStream(tmp_path / "m.safetensors", expected_tensors=6) as out:
        out.add(first)
        out.add(second)
        out.metadata["tensor_names"] = '["a", "b"]'
    tensors, metadata = _read(tmp_path / "m.safetensors")
    assert sorted(tensors) == sorted([*first, *second])
    for name, want in {**first, **second}.items():
        assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), name
    assert metadata == {"tensor_names": '["a", "b"]'}


def test_a_header_larger_than_its_reservation_moves_the_data_once_and_reads_back(tmp_path):
    many = {f"t{i:04d}": torch.full((3,), i, dtype=torch.int16) for i in range(400)}
    with SafetensorsStream(tmp_path / "m.safetensors", expected_tensors=1) as out:  # 4 KiB for 400 entries
        out.add(many)
        out.metadata["note"] = "x" * 5000
    tensors, metadata = _read(tmp_path / "m.safetensors")
    assert len(tensors) == 400 and all(torch.equal(tensors[n], t) for n, t in many.items())
    assert metadata["note"] == "x" * 5000
    assert not list(tmp_path.glob(".*partial*"))


def test_nothing_appears_under_the_name_until_the_file_is_complete(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(RuntimeError, match="quantizing failed"):
        with SafetensorsStream(path) as out:
            out.add({"a": torch.ones(4)})
            assert not path.exists()
            raise RuntimeError("quantizing failed")
    assert not path.exists() and not list(tmp_path.iterdir())


def test_a_tensor_named_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="written twice"):
        with SafetensorsStream(tmp_path / "m.safetensors") as out:
            out.add({"a": torch.ones(1)})
            out.add({"a": torch.zeros(1)})

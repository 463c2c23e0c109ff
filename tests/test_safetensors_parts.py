"""A checkpoint shard in export's key: one digest per tensor (cudabuild.formats.safetensors_parts),
memoised by the shard's stat signature (engine.hashing.FileHasher), and explained tensor by tensor."""

from __future__ import annotations

import functools
import os

import torch

from cudabuild.engine import explain
from cudabuild.engine.hashing import FileHasher
import _checkpoint as checkpoint
from cudabuild.formats.safetensors_parts import tensor_digests, tensor_layouts
from cudabuild.pipeline import PIPELINE

PARTS = {".safetensors": tensor_digests}
reason = functools.partial(explain.reason, pipeline=PIPELINE)  # the engine is handed its stage table


def write_shard(path, **tensors):
    checkpoint.save_file(path, tensors, metadata={"format": "pt"})


def test_each_tensor_has_its_own_digest_and_only_a_changed_one_moves(tmp_path):
    a, b = torch.arange(64, dtype=torch.float32), torch.ones(4, 4, dtype=torch.bfloat16)
    write_shard(tmp_path / "x.safetensors", a=a, b=b)
    before = tensor_digests(tmp_path / "x.safetensors")
    assert set(before) == {"a", "b", "__metadata__"}
    write_shard(tmp_path / "x.safetensors", a=a, b=b * 2)
    after = tensor_digests(tmp_path / "x.safetensors")
    assert after["a"] == before["a"] and after["b"] != before["b"]
    write_shard(tmp_path / "x.safetensors", a=a.view(8, 8), b=b)  # same bytes, another shape
    assert tensor_digests(tmp_path / "x.safetensors")["a"] != before["a"]


def test_a_layout_is_each_tensors_dtype_and_shape_not_its_values(tmp_path):
    """What the quantize stage's `layout` facet is made of (cudabuild.backend.stages.quantize): the
    trace keys on it, so new values keep it and another shape or dtype does not."""
    a, b = torch.arange(64, dtype=torch.float32), torch.ones(4, 4, dtype=torch.bfloat16)
    write_shard(tmp_path / "x.safetensors", a=a, b=b)
    before = tensor_layouts(tmp_path / "x.safetensors")
    assert before == {"a": ["F32", [64]], "b": ["BF16", [4, 4]], "__metadata__": {"format": "pt"}}
    write_shard(tmp_path / "x.safetensors", a=a * 3, b=b * 2)
    assert tensor_layouts(tmp_path / "x.safetensors") == before
    write_shard(tmp_path / "x.safetensors", a=a.view(8, 8), b=b)
    assert tensor_layouts(tmp_path / "x.safetensors")["a"] == ["F32", [8, 8]]
    write_shard(tmp_path / "x.safetensors", a=a.half(), b=b)
    assert tensor_layouts(tmp_path / "x.safetensors")["a"] == ["F16", [64]]


def test_a_file_that_is_not_safetensors_keys_by_its_bytes(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    first = tensor_digests(tmp_path / "bad.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x03")
    assert list(first) == ["<unreadable>"] and tensor_digests(tmp_path / "bad.safetensors") != first


def test_a_touched_shard_is_read_once_and_keys_the_same(tmp_path):
    write_shard(tmp_path / "model.safetensors", w=torch.randn(32, 32))
    (tmp_path / "config.json").write_text("{}")
    calls = []

    def counted(path):
        calls.append(path)
        return tensor_digests(path)

    hasher = FileHasher({})
    parts = {".safetensors": counted}
    first = hasher.tree(tmp_path, parts=parts)
    assert hasher.tree(tmp_path, parts=parts) == first and len(calls) == 1  # a no-op reads nothing
    st = os.stat(tmp_path / "model.safetensors")
    os.utime(tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert hasher.tree(tmp_path, parts=parts) == first and len(calls) == 2  # re-read once: same key
    assert hasher.tree(tmp_path, parts=parts) == first and len(calls) == 2
    assert isinstance(first["config.json"], str)  # other files enter by their sha256


def test_the_reason_names_the_changed_tensor_and_its_shard(tmp_path):
    write_shard(tmp_path / "model-00001-of-00002.safetensors", **{"layers.0.w": torch.zeros(8), "layers.0.v": torch.zeros(8)})
    write_shard(tmp_path / "model-00002-of-00002.safetensors", **{"layers.1.w": torch.zeros(8)})
    hasher = FileHasher({})
    old = {"stage": "export", "checkpoint": hasher.tree(tmp_path, parts=PARTS)}
    write_shard(tmp_path / "model-00001-of-00002.safetensors", **{"layers.0.w": torch.ones(8), "layers.0.v": torch.zeros(8)})
    new = {"stage": "export", "checkpoint": hasher.tree(tmp_path, parts=PARTS)}
    assert reason(old, new) == "checkpoint tensor layers.0.w (model-00001-of-00002.safetensors) changed"

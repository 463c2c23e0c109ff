"""cudabuild.backend.tensor_origins: what a lowering did with the exported program's tensors (handed
on as they are, as views, as copies; read or not), and the lowered program for other weights."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from cudabuild.backend import tensor_origins


def program(**tensors):
    """The parts of an ExportedProgram the watch reads: its state dict and its constants."""
    state = {k: v for k, v in tensors.items() if not k.startswith("cache")}
    return SimpleNamespace(state_dict=state, constants={k: v for k, v in tensors.items() if k.startswith("cache")})


def test_views_and_copies_are_followed_and_reads_are_named():
    w, cache = torch.randn(4, 6), torch.zeros(2, 3)
    ep = program(w=w, cache=cache)
    with tensor_origins.watched(ep) as watch:
        deep = copy.deepcopy(cache)  # how ExecuTorch copies a program's buffers: the storage, as bytes
        cloned = w.clone()
        view = w.t()
        made = torch.full((3,), 2.0)  # the lowering's own
    assert watch.reads == [] and watch.read_count == 0
    lowered = program(w_t=view, w_copy=cloned, cache=deep, made=made, w=w)
    found, unknown = tensor_origins.origins(watch, lowered)
    assert unknown == []
    assert {fqn: o["as"] for fqn, o in found.items()} == {
        "w": "same", "w_t": "view", "w_copy": "copy", "cache": "storage copy"}
    assert {o["from"] for o in found.values()} == {"w", "cache"}

    with tensor_origins.watched(ep) as watch:
        _ = w * 2  # computing from a weight's values
        _ = cache.sum()
    assert watch.read_count == 2 and watch.reads[0] == "aten.mul.Tensor on w"


def test_a_copy_of_a_copy_read_is_a_read_of_the_weight():
    w = torch.randn(3, 3)
    with tensor_origins.watched(program(w=w)) as watch:
        c = w.clone()
        _ = c + 1
    assert watch.reads == ["aten.add.Tensor on w"]


def test_the_lowered_tensors_for_other_weights_take_theirs_where_they_came_from():
    old_w, old_cache = torch.randn(4, 6), torch.zeros(2, 3)
    with tensor_origins.watched(program(w=old_w, cache=old_cache)) as watch:
        lowered = {"w": old_w, "w_t": old_w.t(), "w_copy": old_w.clone(), "cache": copy.deepcopy(old_cache),
                   "made": torch.full((3,), 2.0)}
    found, _ = tensor_origins.origins(watch, program(**lowered))
    new_w, new_cache = torch.randn(4, 6), torch.ones(2, 3)
    out = tensor_origins.for_weights(lowered, found, {"w": new_w, "cache": new_cache})
    assert out["w"] is new_w
    assert torch.equal(out["w_t"], new_w.t()) and out["w_t"].stride() == lowered["w_t"].stride()
    assert torch.equal(out["w_copy"], new_w) and out["w_copy"].untyped_storage().data_ptr() != new_w.untyped_storage().data_ptr()
    assert torch.equal(out["cache"], new_cache) and out["cache"].untyped_storage().data_ptr() != new_cache.untyped_storage().data_ptr()
    assert out["made"] is lowered["made"]


def test_a_real_edge_lowering_reads_no_weight():
    """ExecuTorch's to_edge_transform_and_lower on a model with a KV cache and a conv1d (what the
    edge stage runs) hands every weight on and copies the buffers: nothing read."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from cudabuild.backend import delegate

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=2)
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("cache", torch.zeros(1, 8, 4), persistent=False)

        def forward(self, x, pos):
            y = self.lin(self.conv(x.transpose(1, 2))[..., :1].transpose(1, 2))
            self.cache.index_copy_(2, pos, y.transpose(1, 2))
            return y + self.cache.sum()

    ep = torch.export.export(Cached().eval(), (torch.randn(1, 1, 8), torch.tensor([0])))
    with tensor_origins.watched(ep) as watch, delegate.capture() as captured:
        to_edge_transform_and_lower({"decode": ep}, partitioner={"decode": [delegate.partitioner("decode", {}, "cpu")]},
                                    compile_config=EdgeCompileConfig(_check_ir_validity=False))
    assert watch.reads == []
    found, unknown = tensor_origins.origins(watch, captured["decode"][0])
    assert unknown == [] and {o["from"] for o in found.values()} == {"conv.weight", "conv.bias", "lin.weight", "lin.bias", "cache"}

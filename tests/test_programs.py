"""Programs as stored artifacts (cudabuild.backend.programs): weights written one file each, mapped
back from the store rather than read, handed on unchanged without being written or copied again."""

from __future__ import annotations

import copy

import torch

from cudabuild.backend.programs import StoredWeights, graph_digest, graph_summary, load_program, save_program


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def exported():
    torch.manual_seed(0)
    return torch.export.export(Small().eval(), (torch.randn(2, 16),))


def reader(saved):
    read = lambda name: saved.files[name]  # noqa: E731  a store hands out its verified file
    read.sha = lambda name: saved.shas[name]
    return read


def test_a_saved_program_loads_back_mapped_and_runs_the_same(tmp_path):
    ep = exported()
    saved = save_program(ep, tmp_path / "a")
    assert sorted(n for n in saved.files if n.startswith("tensor.")) == ["tensor.lin.bias", "tensor.lin.weight", "tensor.scale"]
    weights = StoredWeights()
    loaded = load_program(reader(saved), weights)
    assert len(weights.tensors()) == 3  # every weight came from a mapped file
    x = torch.randn(2, 16)
    torch.testing.assert_close(loaded.module()(x), ep.module()(x))
    # The digest keys the weights by their files: the same program saved again gives the same one.
    again = save_program(ep, tmp_path / "b")
    assert graph_digest(graph_summary(ep, saved.weights)) == graph_digest(graph_summary(ep, again.weights))


def test_weights_handed_on_unchanged_are_named_not_written(tmp_path):
    saved = save_program(exported(), tmp_path / "export")
    weights = StoredWeights()
    loaded = load_program(reader(saved), weights)
    loaded.state_dict["lin.bias"] = loaded.state_dict["lin.bias"] + 1  # a stage that changes one weight
    resaved = save_program(loaded, tmp_path / "edge", weights)
    assert set(resaved.reused) == {"tensor.lin.weight", "tensor.scale"}
    assert resaved.reused["tensor.lin.weight"] == saved.shas["tensor.lin.weight"]
    assert "tensor.lin.bias" in resaved.files and resaved.shas["tensor.lin.bias"] != saved.shas["tensor.lin.bias"]
    assert not (tmp_path / "edge" / "tensor.lin.weight").exists()


def test_a_deep_copy_shares_the_mapped_weights_only_inside_the_block(tmp_path):
    saved = save_program(exported(), tmp_path / "a")
    weights = StoredWeights()
    loaded = load_program(reader(saved), weights)
    other = torch.randn(4)
    with weights.shared_when_copied():
        copied = copy.deepcopy(loaded)
        fresh = copy.deepcopy(other)
    assert copied.state_dict["lin.weight"] is loaded.state_dict["lin.weight"]
    assert fresh is not other and torch.equal(fresh, other)
    assert copy.deepcopy(loaded).state_dict["lin.weight"] is not loaded.state_dict["lin.weight"]


def test_a_view_of_a_stored_weight_is_not_taken_for_it(tmp_path):
    saved = save_program(exported(), tmp_path / "a")
    weights = StoredWeights()
    loaded = load_program(reader(saved), weights)
    w = loaded.state_dict["lin.weight"]
    assert weights.sha_of(w) == saved.shas["tensor.lin.weight"]
    assert weights.sha_of(w.t()) is None and weights.sha_of(w[:8]) is None
    assert weights.sha_of(torch.zeros(3)) is None and weights.sha_of(w.clone()) is None


def test_a_lowering_leaves_no_program_alive_behind_it():
    """ExecuTorch memoises every node its lowering compares (is_same_node, without bound), which
    kept each lowered program and its weights alive for the rest of the build: gigabytes per stage
    for a real checkpoint. capture() and emit() drop that memo when they end."""
    import gc
    import weakref

    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.exir.backend import utils

    from cudabuild.backend import delegate

    ep = exported()
    weight = weakref.ref(ep.state_dict["lin.weight"])
    with delegate.capture() as captured:
        to_edge_transform_and_lower({"forward": ep}, partitioner={"forward": [delegate.partitioner("forward", {}, "cpu")]},
                                    compile_config=EdgeCompileConfig(_check_ir_validity=False))
    assert len(captured["forward"]) == 1
    assert utils.is_same_node.cache_info().currsize == 0
    del ep, captured
    gc.collect()
    assert weight() is None


def test_a_written_package_leaves_no_weights_blob_in_memory(tmp_path):
    """torch's fake-tensor caches keep the lowered modules of a package alive after it is
    written, and each held its method's weights blob: as many bytes as the checkpoint, for the rest
    of the build. emit() empties the named data it handed out when it ends."""
    import gc
    import sys

    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from cudabuild.backend import delegate

    blob = bytes(range(256)) * 4096  # 1 MiB, one object that only this test and the package see
    alone = sys.getrefcount(blob)
    with delegate.emit(lambda method: delegate.Compiled(b"so", blob), "cpu"):
        manager = to_edge_transform_and_lower(
            {"forward": exported()}, partitioner={"forward": [delegate.partitioner("forward", {}, "cpu")]},
            compile_config=EdgeCompileConfig(_check_ir_validity=False))
        program = manager.to_executorch()
        program.write_tensor_data_to_file(str(tmp_path))
    assert (tmp_path / "aoti_cpu_blob.ptd").read_bytes().count(blob[:4096]) >= 256  # it was written
    del manager, program
    gc.collect()
    assert sys.getrefcount(blob) == alone


class FromTheEnd(torch.nn.Module):
    """Slices a dynamic length from the end, as ExecuTorch's Qwen3.5-MoE prefill does (`x[..., -T:]`):
    the graph holds `operator.neg` of a size, which ExecuTorch's own serializer does not know."""

    def forward(self, x):
        padded = torch.cat([torch.zeros(1, 3), x], dim=1)
        return padded[:, -x.shape[1]:] * 2


def test_a_program_with_size_arithmetic_from_the_end_saves_and_loads(tmp_path):
    import operator

    from executorch.exir.serde import export_serialize

    T = torch.export.Dim("T", min=2, max=30)
    ep = torch.export.export(FromTheEnd(), (torch.ones(1, 8),), dynamic_shapes=({1: T},), strict=True)
    assert operator.neg in {n.target for n in ep.graph.nodes}
    saved = save_program(ep, tmp_path)
    loaded = load_program(reader(saved))
    x = torch.arange(5.0)[None]
    assert torch.equal(loaded.module()(x), FromTheEnd()(x))
    assert operator.neg not in export_serialize._SYM_INT_OPS  # ExecuTorch's table is left as it was


def test_a_quantized_weight_digests_by_its_inner_tensors():
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    def quantized(seed):
        torch.manual_seed(seed)
        lin = torch.nn.Sequential(torch.nn.Linear(64, 32))
        quantize_(lin, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)))
        return torch.export.export(lin, (torch.randn(1, 64),))

    a, b, c = quantized(0), quantized(0), quantized(1)
    assert type(a.state_dict["0.weight"]).__name__ == "IntxUnpackedToInt8Tensor"
    assert graph_digest(graph_summary(a)) == graph_digest(graph_summary(b)) != graph_digest(graph_summary(c))


class WithScalar(torch.nn.Module):
    """A weight of one element: inductor may write its value into the code."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.gain = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.lin(x) * self.gain


def _digests(module, tmp_path, name):
    from cudabuild.backend.programs import code_digest

    ep = torch.export.export(module.eval(), (torch.randn(2, 16),))
    saved = save_program(ep, tmp_path / name)
    summary = graph_summary(ep, saved.weights)
    return graph_digest(summary), code_digest(ep, summary)


def test_new_weights_keep_the_code_digest_and_a_shape_or_a_one_element_value_does_not(tmp_path):
    torch.manual_seed(0)
    content, code = _digests(WithScalar(), tmp_path, "a")
    torch.manual_seed(1)
    other = WithScalar()
    assert _digests(other, tmp_path, "b") != (content, code)
    assert _digests(other, tmp_path, "b")[1] == code  # other weights, same code
    with torch.no_grad():
        other.gain.fill_(3.0)  # the one-element weight: a value that can decide code
    assert _digests(other, tmp_path, "c")[1] != code
    wider = WithScalar()
    wider.lin = torch.nn.Linear(16, 16, bias=False)
    assert _digests(wider, tmp_path, "d")[1] != code  # a weight fewer: other code


def test_a_programs_tensors_load_without_its_graph(tmp_path):
    from cudabuild.backend.programs import load_tensors, program_tensors

    saved = save_program(exported(), tmp_path / "a")
    tensors = load_tensors(reader(saved))
    expected = program_tensors(load_program(reader(saved)))
    assert sorted(tensors) == sorted(expected)
    for fqn, t in expected.items():
        assert torch.equal(tensors[fqn], t)
    asked = []
    read = reader(saved)
    counting = lambda name: asked.append(name) or read(name)  # noqa: E731
    assert sorted(load_tensors(counting, skip={"lin.weight"})) == ["lin.bias", "scale"]
    assert "tensor.lin.weight" not in asked  # a skipped weight's file is not even asked for

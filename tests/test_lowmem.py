"""cudabuild.backend.lowmem with real torch.export and a real AOTInductor compile (CPU, and CUDA if present)."""

import ctypes
import os

import pytest
import torch
from torch._inductor import compile_fx, graph
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.graph import GraphLowering

from cudabuild.backend.lowmem import (
    LowMemoryPatchError,
    compile_time_cpu_clones,
    is_kv_cache_buffer,
    move_program_to_device,
    release_device_tensors,
)
from cudabuild.errors import CudabuildError

PATCHED = [
    (compile_fx, "clone_preserve_strides"),
    (CppWrapperCpu, "codegen_device"),
    (GraphLowering, "get_original_value_of_constant"),
    (graph, "is_same_tensor"),
]


def current_patch_targets():
    return [getattr(owner, name) for owner, name in PATCHED]


def emptied(*shape, stride=None):
    t = torch.empty_strided(shape, stride or torch.empty(shape).stride())
    t.untyped_storage().resize_(0)
    return t


def test_kv_selection_rule():
    assert is_kv_cache_buffer("layers.0.attn.kv_cache.k_cache", torch.zeros(4, 8))
    assert not is_kv_cache_buffer("layers.0.attn.kv_cache.codebook", torch.arange(1.0, 9.0))
    assert not is_kv_cache_buffer("kv_cache.k", torch.nn.Parameter(torch.zeros(4, 8)))
    assert not is_kv_cache_buffer("layers.0.attn.k_cache", torch.zeros(4, 8))
    assert not is_kv_cache_buffer("kv_cache.k", torch.zeros(0, 8))
    assert not is_kv_cache_buffer("kv_cache.k", torch.zeros(4, 8, device="meta"))


def test_patches_are_undone_after_success_after_an_exception_and_when_nested():
    originals = current_patch_targets()
    unlift = compile_fx._unlift_graph  # wrapped, to tell its clones from every other caller's
    with compile_time_cpu_clones("cpu"):
        inside = current_patch_targets()
        assert all(p is not o for p, o in zip(inside, originals))
        assert compile_fx._unlift_graph is not unlift
        with compile_time_cpu_clones(torch.device("cpu")):
            assert current_patch_targets() == inside
        assert current_patch_targets() == inside
        with pytest.raises(ValueError, match="same device"):
            with compile_time_cpu_clones("cuda"):
                pass
        assert current_patch_targets() == inside
    assert all(p is o for p, o in zip(current_patch_targets(), originals))
    assert compile_fx._unlift_graph is unlift

    with pytest.raises(RuntimeError, match="inside"):
        with compile_time_cpu_clones("cpu"):
            raise RuntimeError("raised inside")
    assert all(p is o for p, o in zip(current_patch_targets(), originals))
    assert compile_fx._unlift_graph is unlift


def test_a_moved_inductor_function_fails_loudly_and_patches_nothing(monkeypatch):
    originals = current_patch_targets()
    monkeypatch.delattr(compile_fx, "_unlift_graph")
    with pytest.raises(LowMemoryPatchError, match="_unlift_graph") as raised:
        with compile_time_cpu_clones("cpu"):
            pass
    # A CudabuildError: the build reports its one line, not a traceback.
    assert isinstance(raised.value, CudabuildError) and "\n" not in str(raised.value)
    assert "low_memory_mode=OFF" in str(raised.value)
    assert all(p is o for p, o in zip(current_patch_targets(), originals))


def test_emptied_tensors_are_never_the_same_but_equal_views_still_are():
    a, b = emptied(8, 4), emptied(8, 4)
    assert graph.is_same_tensor(a, b)  # the stock rule merges freed caches: data_ptr is 0
    base = torch.randn(8, 4)
    with compile_time_cpu_clones("cpu"):
        assert not graph.is_same_tensor(a, b)
        assert not graph.is_same_tensor(a, a)
        assert graph.is_same_tensor(base, base.view(8, 4))
        assert not graph.is_same_tensor(base, base.clone())


class OneBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(4, 6))

    def forward(self, x):
        self.kv_cache.add_(x)
        return self.kv_cache.sum()


def unlift_clone(buffer: torch.Tensor) -> torch.Tensor:
    """The initial-value copy inductor's own _unlift_graph makes of a module's buffer `buffer`."""
    module = OneBuffer()
    ep = torch.export.export(module, (torch.randn(4, 6),))
    module.kv_cache = buffer
    gm = ep.graph_module
    compile_fx._unlift_graph(module, gm, ep.graph_signature)
    (clone,) = [v for v in gm.meta.values() if isinstance(v, torch.Tensor)]
    return clone


def test_unlift_clones_rebuild_freed_buffers_as_zeros_and_other_callers_are_untouched():
    freed = emptied(4, 6, stride=(1, 4))  # column-major: strides must survive
    with compile_time_cpu_clones("cpu"):
        clone = unlift_clone(freed)
        assert clone.shape == freed.shape and clone.stride() == (1, 4)
        assert clone.device.type == "cpu" and not clone.any()
        with pytest.raises(RuntimeError):  # a benchmark clone gets the stock behaviour
            compile_fx.clone_preserve_strides(freed)
        data = torch.randn(4, 6)
        assert torch.equal(compile_fx.clone_preserve_strides(data), data)


class KVCache(torch.nn.Module):
    def __init__(self, rows: int, width: int):
        super().__init__()
        self.register_buffer("k", torch.zeros(rows, width))
        self.register_buffer("v", torch.zeros(rows, width))
        self.register_buffer("codebook", torch.randn(width, width))
        # A plain tensor attribute: export lifts it as a constant, not a buffer, so inductor
        # serialises it through get_original_value_of_constant rather than a clone.
        self.scratch = torch.zeros(2, width)


class TinyDecoder(torch.nn.Module):
    """Writes one row of each cache per call; reads both caches whole."""

    def __init__(self, rows: int = 8, width: int = 4):
        super().__init__()
        self.kv_cache = KVCache(rows, width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, pos):  # x: [1, W], pos: [1]
        cache = self.kv_cache
        cache.k.index_copy_(0, pos, self.proj(x))
        cache.v.index_copy_(0, pos, x @ cache.codebook)
        return cache.k.sum(0) + 10 * cache.v.sum(0) + cache.scratch.sum(0)


def test_low_memory_move_frees_only_kv_content_and_leaves_the_eager_model_alone():
    model = TinyDecoder()
    inputs = (torch.randn(1, 4), torch.tensor([3]))
    ep = move_program_to_device(torch.export.export(model, inputs), "cpu", low_memory=True)
    tensors = {**ep.state_dict, **ep.constants}
    for fqn, shape in (("kv_cache.k", (8, 4)), ("kv_cache.v", (8, 4)), ("kv_cache.scratch", (2, 4))):
        assert tensors[fqn].shape == shape and tensors[fqn].dtype == torch.float32
        assert tensors[fqn].untyped_storage().nbytes() == 0
    assert torch.equal(tensors["kv_cache.codebook"], model.kv_cache.codebook)
    assert isinstance(tensors["proj.weight"], torch.nn.Parameter)
    assert model.kv_cache.k.untyped_storage().nbytes() == 8 * 4 * 4
    assert release_device_tensors(ep) == 0  # CPU storage is not the device's
    assert tensors["kv_cache.codebook"].untyped_storage().nbytes() > 0


AOTI_OPTIONS = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
}


def compile_and_load(ep, inputs, device: str, out_dir):
    with compile_time_cpu_clones(torch.device(device)):
        files = torch._inductor.aot_compile(
            ep.module(), inputs, options={**AOTI_OPTIONS, "aot_inductor.output_path": str(out_dir)}
        )
    so = next(f for f in files if f.endswith(".so"))
    # torch loads libtorch RTLD_LOCAL; on torch 2.11 the runner segfaults on dlopen unless its
    # symbols are global (seen on the H200 even with link_libtorch on).
    for name in ("libtorch_cpu.so", "libtorch_cuda.so"):
        path = os.path.join(os.path.dirname(torch.__file__), "lib", name)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
    blob = next(f for f in files if f.endswith(".blob"))
    if device == "cpu":
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
    else:
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda:0")
    runner.update_constant_buffer_from_blob(blob)
    return runner


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_low_memory_compile_matches_eager(device, tmp_path):
    torch.manual_seed(0)
    with torch.device(device):  # also places the plain `scratch` attribute, which .to() skips
        model, eager = TinyDecoder(), TinyDecoder()
        inputs = (torch.randn(1, 4), torch.tensor([3]))
    eager.load_state_dict(model.state_dict())
    ep = move_program_to_device(torch.export.export(model, inputs), device, low_memory=True)
    assert ep.state_dict["kv_cache.k"].untyped_storage().nbytes() == 0

    runner = compile_and_load(ep, inputs, device, tmp_path)

    fqns = set(runner.get_constant_names_to_original_fqns().values())
    assert {"kv_cache.k", "kv_cache.v", "kv_cache.codebook"} <= fqns  # k and v not merged
    constants = runner.extract_constants_map(False)
    assert torch.equal(constants["kv_cache.codebook"].to(device), model.kv_cache.codebook)
    assert not constants["kv_cache.k"].any() and not constants["kv_cache.v"].any()
    for pos in (3, 5, 3, 0):
        x = torch.randn(1, 4, device=device)
        p = torch.tensor([pos], device=device)
        (out,) = runner.run([x, p])
        torch.testing.assert_close(out, eager(x, p), rtol=1e-5, atol=1e-5)
    release_device_tensors(ep)


def test_a_program_that_calls_triton_kernels_keeps_its_kv_caches_under_low_memory_mode():
    """Freeing the caches crashed ExecuTorch's Qwen3.5-MoE compile on the H200; such a program keeps them."""
    import torch
    from cudabuild.backend.lowmem import calls_triton_kernels, move_program_to_device

    @torch.library.custom_op("triton::cudabuild_lowmem_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @probe.register_fake
    def _(x):
        return torch.empty_like(x)

    class Cached(torch.nn.Module):
        def __init__(self, triton: bool):
            super().__init__()
            self.triton = triton
            self.register_buffer("kv_cache", torch.zeros(4, 4))

        def forward(self, x):
            y = torch.ops.triton.cudabuild_lowmem_probe(x) if self.triton else x + 1
            return y + self.kv_cache

    x = torch.ones(4, 4)
    for triton in (False, True):
        ep = torch.export.export(Cached(triton), (x,))
        assert calls_triton_kernels(ep) is triton
        moved = move_program_to_device(ep, "cpu", low_memory=True)
        assert (moved.state_dict["kv_cache"].untyped_storage().nbytes() > 0) is triton


class NormedDecoder(torch.nn.Module):
    """A KV cache, a linear, and a Gemma-style norm whose `1 + weight` reads a weight alone (the
    kind of constant arithmetic fake-tensor propagation computes for real)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(8, 4))
        self.register_buffer("codebook", torch.randn(4, 4))
        self.proj = torch.nn.Linear(4, 4)
        self.norm_weight = torch.nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x, pos):  # x: [1, W], pos: [1]
        self.k.index_copy_(0, pos, self.proj(x))
        y = self.k.sum(0) @ self.codebook
        return y * torch.rsqrt(y.pow(2).mean() + 1e-6) * (1.0 + self.norm_weight)


def test_weights_left_on_the_host_compile_to_a_program_whose_blob_is_theirs(tmp_path):
    """weights_on_device=False: every weight a device tensor with no storage; AOTInductor's own
    blob never built (captured_table's keep_out); the table proven on the host tensors themselves;
    the blob written from them runs as the model does."""
    from cudabuild.backend import aoti_constants
    from cudabuild.backend.lowmem import host_copy
    from cudabuild.backend.stages.compile import _no_inlined_constants  # as the compile stage compiles

    torch.manual_seed(0)
    model, eager = NormedDecoder(), NormedDecoder()
    eager.load_state_dict(model.state_dict())
    inputs = (torch.randn(1, 4), torch.tensor([3]))
    ep = torch.export.export(model, inputs)
    program = {**ep.state_dict, **ep.constants}  # the program's tensors, as the store holds them
    ep = move_program_to_device(ep, "cpu", low_memory=True, weights_on_device=False)
    placed = {**ep.state_dict, **ep.constants}
    for fqn in ("proj.weight", "proj.bias", "codebook", "norm_weight", "k"):
        assert placed[fqn].untyped_storage().nbytes() == 0 and placed[fqn].shape == program[fqn].shape
    assert host_copy(placed["proj.weight"]) is program["proj.weight"]  # its values: the program's own
    assert host_copy(placed["k"]) is not None  # written, but this IR does not say: its initial values kept

    with _no_inlined_constants(), compile_time_cpu_clones("cpu"), aoti_constants.captured_table(keep_out=True) as table:
        files = torch._inductor.aot_compile(ep.module(), inputs,
                                            options={**AOTI_OPTIONS, "aot_inductor.output_path": str(tmp_path)})
    assert not [f for f in files if f.endswith(".blob") and os.path.exists(f)]  # never built, nor written
    assert aoti_constants.source_problem(dict(table), table.sources, program) is None
    assert {row["fqn"] for row in table["constants"]} >= {"proj.weight", "codebook", "norm_weight"}
    blob = tmp_path / "ours.blob"
    aoti_constants.write_blob(blob, dict(table), program)
    assert blob.stat().st_size == table["size"]
    so = next(f for f in files if f.endswith(".so"))
    aoti_constants.promote_libtorch("cpu")
    assert aoti_constants.so_table_problem(dict(table), aoti_constants.constants_table(so)) is None
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
    runner.update_constant_buffer_from_blob(str(blob))
    for pos in (3, 5, 3, 0):
        x = torch.randn(1, 4)
        p = torch.tensor([pos])
        (out,) = runner.run([x, p])
        torch.testing.assert_close(out, eager(x, p), rtol=1e-5, atol=1e-5)
    release_device_tensors(ep)
    assert host_copy(placed["proj.weight"]) is None  # forgotten with the program's device storage

    # A blob from other bytes than the sources is named: the proof is not a formality.
    other = dict(program, **{"proj.weight": torch.nn.Parameter(program["proj.weight"] + 1)})
    assert aoti_constants.source_problem(dict(table), table.sources, other) == \
        "the weights blob's bytes for proj.weight differ from the program's"

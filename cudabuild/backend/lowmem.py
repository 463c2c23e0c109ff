"""Low-memory AOTInductor compile: keep zero KV caches and mutated-buffer clones off the device.

Owns the low-memory behaviour of ExecuTorch's CUDA backend as separate, scoped pieces:
- which buffers are KV-cache content that may be freed (`is_kv_cache_buffer`),
- moving a program to the device with those buffers' storage freed (`move_program_to_device`),
- the compile-time patches of inductor that clone mutated buffers onto the CPU and re-create the
  freed caches as zeros (`compile_time_cpu_clones`),
- freeing a compiled program's device storage before the next method (`release_device_tensors`).

Must not touch: inductor config or os.environ. The patches are process-wide while the context is
open (inductor serialises constants from worker threads, so they cannot be thread-local), and
they are all undone when it closes; do not compile an unrelated program in another thread
meanwhile. Their state lives in one object per process (`CompileTimePatches`), not in module
globals. The stage's other process-wide patches, and the order they nest in, are listed in
cudabuild.backend.stages.compile.compile_scope.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Any, ContextManager, Iterator, Mapping, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from cudabuild.errors import CudabuildError

Device = Union[str, torch.device]

KV_CACHE_MARKER = "kv_cache"


class LowMemoryPatchError(CudabuildError):
    """Inductor no longer has a function, or a call, that the low-memory patches rely on."""


def is_kv_cache_buffer(fqn: str, tensor: Any) -> bool:
    """True for KV-cache content that may be freed and re-created as zeros.

    Only a buffer (not a Parameter) whose FQN contains `kv_cache`, with elements, not on the meta
    device, and all zeros. The zero test is what keeps non-zero constants that cache modules
    register beside the cache (codebooks, rotations) intact whatever they are called.
    """
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch.nn.Parameter):
        return False
    if KV_CACHE_MARKER not in fqn or tensor.numel() == 0 or tensor.is_meta:
        return False
    return not bool(torch.any(tensor))


def _is_emptied(value: Any) -> bool:
    """A tensor with elements whose storage was freed with `resize_(0)`."""
    return (
        isinstance(value, torch.Tensor)
        and value.numel() > 0
        and not value.is_meta
        and value.untyped_storage().nbytes() == 0
    )


def _storage_span(x: torch.Tensor) -> int:
    """Elements of storage that `x`'s sizes and strides reach, from its offset."""
    if x.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(x.size(), x.stride()))


def _zeros_preserving_strides(x: torch.Tensor, device: Device) -> torch.Tensor:
    flat = torch.zeros(_storage_span(x), dtype=x.dtype, device=device)
    return torch.as_strided(flat, x.size(), x.stride())


def _copy_preserving_strides(x: torch.Tensor, device: Device) -> torch.Tensor:
    # Copy only the span x reaches, straight to `device`: no transient clone on x's device.
    span = torch.as_strided(x, (_storage_span(x),), (1,))
    flat = span.to(device, copy=True)
    return torch.as_strided(flat, x.size(), x.stride())


def _emptied_like(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x`'s shape, strides and dtype on `device`, with no storage."""
    # empty_strided allocates before the resize frees it: the transient is this one buffer.
    t = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def _point_graph_at_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Retarget burnt-in device kwargs, `aten.to.device` targets and meta vals to `device`."""
    target = str(device)

    def retarget(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": target}
            if node.op == "call_function" and node.target is torch.ops.aten.to.device:
                args = list(node.args)
                args[1] = target
                node.args = tuple(args)
            node.meta["val"] = pytree.tree_map(retarget, node.meta.get("val"))


def calls_triton_kernels(ep: ExportedProgram) -> bool:
    """True when `ep` calls user Triton kernels (ExecuTorch's `torch.ops.triton.*`, or a wrapped kernel).

    Such a program keeps its KV caches resident under low_memory_mode: measured on the H200
    (torch 2.11, ExecuTorch's Qwen3.5-MoE at `size=35b-a3b layers=4`, whose fourth layer is full
    attention), freeing them made the AOTI compile fail with an illegal memory access, as the
    stock exporter with ON does; with them resident ON built both methods. The caches are a few
    MiB a layer at max_seq_len 4096; the mutated-buffer clones on the CPU are the saving that stays.
    """
    for module in ep.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            if getattr(node.target, "namespace", None) == "triton":
                return True
            if "triton_kernel_wrapper" in getattr(node.target, "__name__", ""):
                return True
    return False


def move_program_to_device(
    ep: ExportedProgram, device: Device, *, low_memory: bool
) -> ExportedProgram:
    """Move `ep` (in place, and return it) to `device` for an AOTI compile.

    Without `low_memory` this is `torch.export.passes.move_to_device_pass`. With it, the moves are
    the same except that KV-cache content (`is_kv_cache_buffer`) is placed on `device` with its
    storage freed, one tensor at a time (unless the program calls Triton kernels,
    `calls_triton_kernels`): device checks on the cache updates still pass, and the
    caches occupy no memory until `compile_time_cpu_clones` re-creates them as zeros. The
    program's original tensors are not modified (the eager model keeps its buffers).
    """
    device = torch.device(device)
    if not low_memory:
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(ep, device)
    free_caches = not calls_triton_kernels(ep)

    for fqn, value in ep.state_dict.items():
        if isinstance(value, torch.nn.Parameter):
            ep._state_dict[fqn] = torch.nn.Parameter(value.to(device), value.requires_grad)
        elif free_caches and is_kv_cache_buffer(fqn, value):
            ep._state_dict[fqn] = _emptied_like(value, device)
        else:
            ep._state_dict[fqn] = value.to(device)
    for fqn, value in ep.constants.items():
        if not isinstance(value, torch.Tensor):
            continue
        if free_caches and is_kv_cache_buffer(fqn, value):
            ep._constants[fqn] = _emptied_like(value, device)
        else:
            ep._constants[fqn] = value.to(device)

    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        ep._example_inputs = (
            pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), args),
            pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), kwargs),
        )
    _point_graph_at_device(ep.graph_module, device)
    ep.validate()
    return ep


def release_device_tensors(ep: ExportedProgram) -> int:
    """Free the device storage of `ep`'s state dict and constants; return the bytes freed.

    For after a method's compile, so the next method's move can reuse the memory; `ep` is not
    usable afterwards. CPU (and meta) tensors are left alone; a storage that refuses to resize
    (shared, or not owned by torch) is skipped.
    """
    freed = 0
    pools = [getattr(ep, "state_dict", None) or {}, getattr(ep, "constants", None) or {}]
    for pool in pools:
        for value in pool.values():
            if not isinstance(value, torch.Tensor) or value.device.type in ("cpu", "meta"):
                continue
            storage = value.untyped_storage()
            size = storage.nbytes()
            try:
                storage.resize_(0)
            except RuntimeError:
                continue
            freed += size
    return freed


# ---- compile-time patches ------------------------------------------------------------------


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise LowMemoryPatchError(
            f"torch {torch.__version__}: {what}, and low_memory_mode=ON relies on it: build with "
            "low_memory_mode=OFF, or update cudabuild.backend.lowmem for this torch"
        )


def _code_of(owner: Any, name: str) -> Any:
    fn = getattr(owner, name, None)
    _require(callable(fn), f"{getattr(owner, '__name__', owner)}.{name} is missing")
    return getattr(fn, "__code__", None)


def _codes_in(module: Any) -> Iterator[Any]:
    """The code of every function defined in `module` (under any decorators), nested ones included."""
    functions = (inspect.unwrap(fn) for fn in vars(module).values() if inspect.isfunction(fn))
    pending = [fn.__code__ for fn in functions if fn.__module__ == module.__name__]
    while pending:
        code = pending.pop()
        yield code
        pending.extend(c for c in code.co_consts if inspect.iscode(c))


def _patch_targets() -> dict:
    """Inductor's objects the patches replace, checked for the calls they rely on."""
    from torch._inductor import compile_fx, graph
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.graph import GraphLowering

    unlift = _code_of(compile_fx, "_unlift_graph")
    _code_of(compile_fx, "clone_preserve_strides")
    _require(
        "clone_preserve_strides" in unlift.co_names,
        "compile_fx._unlift_graph no longer calls the module-level clone_preserve_strides",
    )
    _require(
        any("_unlift_graph" in code.co_names for code in _codes_in(compile_fx) if code is not unlift),
        "compile_fx no longer calls its module-level _unlift_graph",
    )
    _code_of(CppWrapperCpu, "codegen_device")
    constructor = _code_of(CppWrapperCpu, "codegen_model_constructor")
    _require(
        "codegen_device" in constructor.co_names and "tensor" in constructor.co_varnames,
        "CppWrapperCpu.codegen_model_constructor no longer writes each constant's device with "
        "self.codegen_device(tensor.device)",
    )
    _code_of(GraphLowering, "get_original_value_of_constant")
    _code_of(graph, "is_same_tensor")
    dedup = _code_of(GraphLowering, "allocate_non_dup_const_name")
    _require(
        "is_same_tensor" in dedup.co_names,
        "GraphLowering.allocate_non_dup_const_name no longer de-duplicates with graph.is_same_tensor",
    )
    return {
        "compile_fx": compile_fx,
        "graph": graph,
        "CppWrapperCpu": CppWrapperCpu,
        "GraphLowering": GraphLowering,
    }


class _Session:
    """One outermost `compile_time_cpu_clones` block: its target device, the CPU copies it made,
    and inductor's functions its patches replaced (put back by `uninstall`)."""

    def __init__(self, target_device: torch.device):
        self.target_device = target_device
        # id -> tensor for values we placed on the CPU in place of device ones; holding the
        # tensors keeps their ids from being reused while the session lives.
        self.forced_to_cpu: dict[int, torch.Tensor] = {}
        self.zeros_for_emptied: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lock = threading.Lock()
        # How deep this thread is in compile_fx._unlift_graph: the one caller whose clones go to
        # the CPU. Thread-local because autotuning may benchmark (and clone) in other threads.
        self.unlifting = threading.local()
        self.originals: dict[tuple[Any, str], Any] = {}

    def note_forced(self, source: torch.Tensor, cpu_value: torch.Tensor) -> torch.Tensor:
        if source.device.type != "cpu":
            self.forced_to_cpu[id(cpu_value)] = cpu_value
        return cpu_value

    def zeros_for(self, emptied: torch.Tensor) -> torch.Tensor:
        with self.lock:
            entry = self.zeros_for_emptied.get(id(emptied))
            if entry is None:
                zeros = self.note_forced(emptied, _zeros_preserving_strides(emptied, "cpu"))
                entry = self.zeros_for_emptied[id(emptied)] = (emptied, zeros)
            return entry[1]

    def in_unlift(self) -> bool:
        return getattr(self.unlifting, "depth", 0) > 0

    def install(self, targets: Mapping[str, Any]) -> None:
        compile_fx, graph = targets["compile_fx"], targets["graph"]
        wrapper_cls, lowering_cls = targets["CppWrapperCpu"], targets["GraphLowering"]
        unlift = compile_fx._unlift_graph
        clone = compile_fx.clone_preserve_strides
        codegen_device = wrapper_cls.codegen_device
        original_value = lowering_cls.get_original_value_of_constant
        is_same = graph.is_same_tensor
        session = self

        @functools.wraps(unlift)
        def unlift_with_cpu_clones(*args: Any, **kwargs: Any) -> Any:
            unlifting = session.unlifting
            unlifting.depth = getattr(unlifting, "depth", 0) + 1
            try:
                return unlift(*args, **kwargs)
            finally:
                unlifting.depth -= 1

        def clone_mutated_buffer_to_cpu(x: torch.Tensor) -> torch.Tensor:
            # Autotuning benchmarks call this too and need their clones on the device; only the
            # initial-value copies of mutated buffers made by _unlift_graph go to the CPU.
            if not session.in_unlift():
                return clone(x)
            if _is_emptied(x):
                return session.zeros_for(x)
            return session.note_forced(x, _copy_preserving_strides(x, "cpu"))

        def codegen_device_of_target(self: Any, device: torch.device) -> str:
            # The constants table must name the device the runtime loads a constant onto; for a
            # value we moved to the CPU that is the compile's target. Genuine CPU constants and
            # every other device argument (allocations, extern op args) are left as they are.
            # The caller's frame is the only place that says which constant this device is for:
            # codegen_device receives `tensor.device` alone, and codegen_model_constructor holds
            # the tensor in its local `tensor` (both checked by _patch_targets).
            if isinstance(device, torch.device) and device.type == "cpu":
                caller = sys._getframe(1)
                if (
                    caller.f_code.co_name == "codegen_model_constructor"
                    and id(caller.f_locals.get("tensor")) in session.forced_to_cpu
                ):
                    device = session.target_device
            return codegen_device(self, device)

        def original_value_with_zeros(self: Any, name: str) -> torch.Tensor:
            # A freed KV cache would serialise as 0 bytes; the weights blob must hold its zeros.
            value = original_value(self, name)
            return session.zeros_for(value) if _is_emptied(value) else value

        def same_unless_emptied(data: torch.Tensor, value: torch.Tensor) -> bool:
            # Freed storages all report data_ptr 0, which would merge every same-shaped cache into
            # one constant.
            if _is_emptied(data) or _is_emptied(value):
                return False
            return is_same(data, value)

        replacements = {
            (compile_fx, "_unlift_graph"): unlift_with_cpu_clones,
            (compile_fx, "clone_preserve_strides"): clone_mutated_buffer_to_cpu,
            (wrapper_cls, "codegen_device"): codegen_device_of_target,
            (lowering_cls, "get_original_value_of_constant"): original_value_with_zeros,
            (graph, "is_same_tensor"): same_unless_emptied,
        }
        for (owner, name), replacement in replacements.items():
            self.originals[(owner, name)] = getattr(owner, name)
            setattr(owner, name, replacement)

    def uninstall(self) -> None:
        for (owner, name), value in self.originals.items():
            setattr(owner, name, value)
        self.originals = {}


class CompileTimePatches:
    """The process's compile-time patches of inductor, and how deep their blocks are nested.

    One instance per process (`_PATCHES`), because what it patches is module state of inductor:
    the outermost open block checks inductor and installs the patches with a fresh `_Session`,
    inner blocks for the same device share it, and the outermost close puts everything back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._session: Optional[_Session] = None

    @contextlib.contextmanager
    def open(self, target_device: Device) -> Iterator[None]:
        target_device = torch.device(target_device)
        with self._lock:
            if self._depth == 0:
                targets = _patch_targets()
                session = _Session(target_device)
                session.install(targets)
                self._session = session
            elif self._session is not None and self._session.target_device != target_device:
                raise ValueError(
                    f"compile_time_cpu_clones({target_device}) inside an open block for "
                    f"{self._session.target_device}: nest only blocks for the same device"
                )
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._session is not None:
                    self._session.uninstall()
                    self._session = None


_PATCHES = CompileTimePatches()


def compile_time_cpu_clones(target_device: Device) -> ContextManager[None]:
    """Patch inductor, for the block, so a low-memory compile keeps its copies on the CPU.

    While open: the initial-value clones `_unlift_graph` makes of mutated buffers are made on the
    CPU (freed KV caches come back as zeros with their strides); the C++ wrapper's constants
    table still records `target_device` for those values; freed constants serialise as zeros;
    and freed tensors are never de-duplicated against each other. Inductor's functions are
    checked first (LowMemoryPatchError if one moved). Re-entrant for the same target device;
    every patch is undone when the outermost block exits, normally or by an exception.
    """
    return _PATCHES.open(target_device)

"""Low-memory AOTInductor compile: keep zero KV caches, mutated-buffer clones and (where the compile
never runs the program) the weights themselves off the device.

Owns the low-memory behaviour of ExecuTorch's CUDA backend as separate, scoped pieces:
- which buffers are KV-cache content that may be freed (`is_kv_cache_buffer`),
- moving a program to the device with those buffers' storage freed (`move_program_to_device`),
  and with `weights_on_device=False` every weight too: each is a device tensor of its shape,
  strides and dtype with no storage, and its values stay on the host (`host_copy`);
- the compile-time patches of inductor that clone mutated buffers onto the CPU, re-create the
  freed caches as zeros and answer for a freed weight with its host copy wherever inductor asks
  for a constant's original value (`compile_time_cpu_clones`),
- freeing a compiled program's device storage before the next method (`release_device_tensors`).

Why the weights may stay off the device: with Triton's tuning done at compile time
(`autotune_at_compile_time`, torch's own default for AOTInductor), inductor never runs the
program while it compiles; it times each kernel on example values it makes itself, and reads a
constant's values only to write the weights blob (which the compile stage keeps out of memory:
aoti_constants.constants_kept_out) and its table (shapes, strides, sizes: the host copy has them).
Measured on the H100 at 40 layers of Qwen3.5-35B-A3B with the weights on the device:
compile.prefill peaked at 22.35 GiB, nearly all of it the 19 GiB of weights. A compile that runs
the program to tune its kernels (`autotune_at_compile_time=OFF`) needs them there.

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


def point_graph_at_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
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
    ep: ExportedProgram, device: Device, *, low_memory: bool, weights_on_device: bool = True
) -> ExportedProgram:
    """Move `ep` (in place, and return it) to `device` for an AOTI compile.

    Without `low_memory` this is `torch.export.passes.move_to_device_pass`. With it, the moves are
    the same except that KV-cache content (`is_kv_cache_buffer`) is placed on `device` with its
    storage freed, one tensor at a time (unless the program calls Triton kernels,
    `calls_triton_kernels`): device checks on the cache updates still pass, and the
    caches occupy no memory until `compile_time_cpu_clones` re-creates them as zeros. With
    `weights_on_device` False too, every other tensor but the program's state (the buffers it
    writes) and its one-element scalars (whose values inductor may read to fold them) is placed
    the same way, its values kept on the host for the compile-time patches (`host_copy`). The
    program's original tensors are not modified (the eager model keeps its buffers).
    """
    device = torch.device(device)
    if not low_memory:
        if not weights_on_device:
            raise ValueError("weights_on_device=False needs low_memory (its compile-time patches)")
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(ep, device)
    free_caches = not calls_triton_kernels(ep)
    written = set(ep.graph_signature.buffers_to_mutate.values())

    def placed(fqn: str, value: torch.Tensor) -> torch.Tensor:
        if free_caches and is_kv_cache_buffer(fqn, value):
            return _emptied_like(value, device)
        if not weights_on_device and fqn not in written and _streamable(value):
            return _PATCHES.keep_on_host(value, device)
        return value.to(device)

    for fqn, value in ep.state_dict.items():
        moved = placed(fqn, value)
        ep._state_dict[fqn] = torch.nn.Parameter(moved, value.requires_grad) if isinstance(value, torch.nn.Parameter) else moved
    for fqn, value in ep.constants.items():
        if isinstance(value, torch.Tensor):
            ep._constants[fqn] = placed(fqn, value)

    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        ep._example_inputs = (
            pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), args),
            pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), kwargs),
        )
    point_graph_at_device(ep.graph_module, device)
    ep.validate()
    return ep


def _streamable(value: torch.Tensor) -> bool:
    """A plain tensor of more than one element: a weight whose values no compile decision reads
    (a tensor subclass keeps whatever its own `to` does; a scalar may be folded into the code)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.numel() > 1 and not value.is_meta


def host_copy(value: torch.Tensor) -> Optional[torch.Tensor]:
    """The host tensor a weight placed with `weights_on_device=False` stands for, or None."""
    return _PATCHES.host_copy(value)


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
            if not isinstance(value, torch.Tensor):
                continue
            _PATCHES.forget_host_copy(value)
            if value.device.type in ("cpu", "meta"):
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
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    _require(callable(getattr(FakeTensorProp, "get_attr", None)) and hasattr(FakeTensorProp, "__init__"),
             "torch.fx.passes.fake_tensor_prop.FakeTensorProp has no get_attr")
    return {
        "FakeTensorProp": FakeTensorProp,
        "compile_fx": compile_fx,
        "graph": graph,
        "CppWrapperCpu": CppWrapperCpu,
        "GraphLowering": GraphLowering,
    }


_INHERITED = object()  # an attribute a patched class had only from its bases


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
        fake_prop = targets["FakeTensorProp"]
        interpreter_get_attr = fake_prop.get_attr
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
                host = _PATCHES.host_copy(x)  # a written buffer left on the host: its initial values
                return session.note_forced(x, _copy_preserving_strides(host, "cpu")) if host is not None else session.zeros_for(x)
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
            # A freed weight is its host copy: its bytes, storage size and offset are what the
            # constants table and the weights blob must say (its device is the target's, in the
            # table). A freed KV cache would serialise as 0 bytes; the weights blob must hold its zeros.
            value = original_value(self, name)
            if not _is_emptied(value):
                return value
            host = _PATCHES.host_copy(value)
            return session.note_forced(value, host) if host is not None else session.zeros_for(value)

        def same_unless_emptied(data: torch.Tensor, value: torch.Tensor) -> bool:
            # Freed storages all report data_ptr 0, which would merge every same-shaped cache into
            # one constant.
            if _is_emptied(data) or _is_emptied(value):
                return False
            return is_same(data, value)

        def get_attr_fake_if_freed(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
            # Fake-tensor propagation runs an op for real where its inputs are all real tensors
            # (the constants: `1.0 + norm.weight`, `bias * 1`), which would read a freed tensor's
            # missing storage. A freed tensor is handed on as the fake tensor of its metadata.
            value = interpreter_get_attr(self, target, args, kwargs)
            return self._mode.from_tensor(value, static_shapes=True) if _is_emptied(value) else value

        replacements = {
            (fake_prop, "get_attr"): get_attr_fake_if_freed,
            (compile_fx, "_unlift_graph"): unlift_with_cpu_clones,
            (compile_fx, "clone_preserve_strides"): clone_mutated_buffer_to_cpu,
            (wrapper_cls, "codegen_device"): codegen_device_of_target,
            (lowering_cls, "get_original_value_of_constant"): original_value_with_zeros,
            (graph, "is_same_tensor"): same_unless_emptied,
        }
        for (owner, name), replacement in replacements.items():
            # Only what the owner itself defines is put back; an inherited attribute is deleted again.
            self.originals[(owner, name)] = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
            setattr(owner, name, replacement)

    def uninstall(self) -> None:
        for (owner, name), value in self.originals.items():
            if value is _INHERITED:
                delattr(owner, name)
            else:
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
        # The host tensors of weights placed with weights_on_device=False, by the device tensor's
        # storage (its StorageImpl: the same for every tensor object inductor makes of it, freed or not).
        self._host_copies: dict[int, torch.Tensor] = {}

    def keep_on_host(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device tensor with `value`'s shape, strides and dtype and no storage, whose values are
        `value`'s on the host (a compact copy where `value` is a view into a larger storage, as
        `.to(device)` would have made it)."""
        compact = value.storage_offset() == 0 and value.untyped_storage().nbytes() == _storage_span(value) * value.element_size()
        host = value if value.device.type == "cpu" and compact else _copy_preserving_strides(value, "cpu")
        placed = _emptied_like(host, device)
        with self._lock:
            self._host_copies[placed.untyped_storage()._cdata] = host
        return placed

    def host_copy(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        return self._host_copies.get(value.untyped_storage()._cdata) if isinstance(value, torch.Tensor) else None

    def forget_host_copy(self, value: torch.Tensor) -> None:
        with self._lock:
            self._host_copies.pop(value.untyped_storage()._cdata, None)

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

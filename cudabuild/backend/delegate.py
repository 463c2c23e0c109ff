"""cudabuild's own ExecuTorch backend, used twice: to capture what the AOTI backend would be handed,
and to emit already-compiled results into a .pte.

ExecuTorch finds a backend by class name among `BackendDetails` subclasses, and which class wins a
name clash depends on import order, so cudabuild never relies on shadowing `CudaBackend`. It
lowers with its own class, `CudabuildAotiBackend`, through ExecuTorch's `AotiPartitioner`
(library-grade: it tags every op, constant and mutated buffer into convex partitions), and renames
the lowered modules' backend id afterwards to the id the runtime dispatches on (`CudaBackend`).

- capture: `preprocess` receives exactly the delegated edge program the stock CUDA backend would
  get; it records it and returns placeholder bytes. The edge stage stores what was captured.
- emit: `preprocess` looks the method's compiled .so and weights blob up and returns them in
  the runtime's layout: named data `<sha256>_so_blob` (inside the .pte) and
  `<sha256>_weights_blob` (external tag `aoti_<device>_blob`, i.e. the .ptd), processed bytes =
  the two keys separated by a newline.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec

BACKEND_NAME = "CudabuildAotiBackend"
# The delegate id the runtime dispatches on, per target. ExecuTorch has no CPU AOTI runtime: the
# cpu target's .pte is verified through torch's AOTI runner, so it carries a cudabuild-only id.
RUNTIME_BACKEND_ID = {"cuda": "CudaBackend", "cpu": "CudabuildAotiCpu"}
METHOD_NAME_KEY = "method_name"


@dataclass(frozen=True)
class Compiled:
    so: bytes
    weights: bytes
    weights_sha: Optional[str] = None  # sha256 of `weights`, when the caller knows it (saves a pass over GBs)


_capture: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("cudabuild_capture", default=None)
# emit(): (lookup, device, the named data handed to ExecuTorch so far)
_emit: contextvars.ContextVar[Optional[tuple[Callable[[str], Compiled], str, list]]] = contextvars.ContextVar(
    "cudabuild_emit", default=None
)


def method_of(compile_specs: list[CompileSpec]) -> str:
    for spec in compile_specs:
        if spec.key == METHOD_NAME_KEY:
            return spec.value.decode()
    raise ValueError("compile specs carry no method_name")


class CudabuildAotiBackend(BackendDetails):
    @staticmethod
    def preprocess(edge_program, compile_specs: list[CompileSpec]) -> PreprocessResult:
        method = method_of(compile_specs)
        captured = _capture.get()
        if captured is not None:
            captured.setdefault(method, []).append(edge_program)
            return PreprocessResult(processed_bytes=b"")
        emit = _emit.get()
        if emit is None:
            raise RuntimeError(f"{BACKEND_NAME} used outside capture() or emit() (method {method})")
        lookup, device, handed = emit
        result = _emit_result(lookup(method), device)
        handed.append(result.data_store_output)
        return result


def _emit_result(compiled: Compiled, device: str) -> PreprocessResult:
    from executorch.exir._serialize._named_data_store import NamedDataStore

    so_key = hashlib.sha256(compiled.so).hexdigest() + "_so_blob"
    weights_key = (compiled.weights_sha or hashlib.sha256(compiled.weights).hexdigest()) + "_weights_blob"
    store = NamedDataStore()
    store.add_named_data(so_key, compiled.so, 1, None)
    store.add_named_data(weights_key, compiled.weights, 1, f"aoti_{device}_blob")
    return PreprocessResult(
        processed_bytes=f"{so_key}\n{weights_key}".encode(),
        debug_handle_map={},
        data_store_output=store.get_named_data_store_output(),
    )


def forget_lowered_graphs() -> None:
    """Drop what ExecuTorch's lowering keeps after it returns.

    `executorch.exir.backend.utils.is_same_node` is memoised without bound (lru_cache(maxsize=None))
    on the fx nodes it compares, so every graph a lowering saw stays alive, and with it the
    delegated programs and their weights: for a real checkpoint, gigabytes per stage, added up
    over a build. Called when each lowering block below ends.
    """
    from executorch.exir.backend import utils

    cached = getattr(utils, "is_same_node", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


@contextlib.contextmanager
def capture():
    """Within this block, lowering records each method's delegated programs: {method: [ep, ...]}."""
    captured: dict = {}
    token = _capture.set(captured)
    try:
        yield captured
    finally:
        _capture.reset(token)
        forget_lowered_graphs()


@contextlib.contextmanager
def emit(lookup: Callable[[str], Compiled], device: str):
    """Within this block, lowering emits `lookup(method)` as each method's delegate. Write the
    package inside the block: when it ends, the named data it handed out is emptied.

    That is because torch keeps the lowered modules alive after the lowering returns: its
    fake-tensor dispatch caches (`FakeTensorMode.cache`, and each ShapeEnv's `fake_tensor_cache`,
    which ShapeEnv's memoised methods keep alive) hold them in their keys, and each lowered module
    holds its method's .so and weights blob. For a real checkpoint that is as many bytes as the
    weights, for the rest of the build. Emptying the buffers we handed out frees them whoever
    holds the module; clearing torch's caches would depend on which caches this torch has.
    """
    handed: list = []
    token = _emit.set((lookup, device, handed))
    try:
        yield
    finally:
        _emit.reset(token)
        for output in handed:
            output.buffers.clear()
        forget_lowered_graphs()


def partitioner(method: str, specs: dict[str, str], target: str):
    """ExecuTorch's AOTI partitioner pointed at our backend, with the specs the .pte must carry."""
    import warnings

    from executorch.backends.aoti.aoti_partitioner import AotiPartitioner

    compile_specs = [CompileSpec(METHOD_NAME_KEY, method.encode())]
    compile_specs += [CompileSpec(k, v.encode()) for k, v in sorted(specs.items())]
    if target == "cuda":
        compile_specs.append(CompileSpec("target_device", b"cuda:0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental API" noise on every construction
        return AotiPartitioner(BACKEND_NAME, compile_specs)


def rename_delegates(edge_manager, methods: list[str], target: str) -> int:
    """Point every lowered module at the runtime's backend id; returns how many were renamed."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    renamed = 0
    for method in methods:
        for module in edge_manager.exported_program(method).graph_module.modules():
            if isinstance(module, LoweredBackendModule) and module.backend_id == BACKEND_NAME:
                module._backend_id = RUNTIME_BACKEND_ID[target]
                renamed += 1
    return renamed

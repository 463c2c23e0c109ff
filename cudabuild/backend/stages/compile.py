"""compile: AOTInductor on one method's edge program -> model.so + constants.json (+ autotune.json).

The compiled code is keyed on what decides it: the edge program's code digest (its structure and
its tensors' names, dtypes, shapes, strides and devices, not the weights' values: see
cudabuild.backend.programs), the specs, the toolchain and any pinned tuning. So new weights for the
same model compile nothing: the blob stage (cudabuild.backend.stages.blob) writes their weights
blob for this code, from `constants.json`, the table of the .so's constants (name, FQN, offset,
size, dtype, shape, strides) taken from inductor as it writes the .so. The compile proves that
table on AOTInductor's own blob: rebuilt from the program's tensors by the table, it must be that
blob byte for byte (`constants.rewritable` in the value, with why not). AOTInductor's blob is
never built: its serializer is handed no constant's values, and the table is proven on what it
would have copied, each constant's original value (aoti_constants.captured_table, source_problem),
so the compile holds no copy of the weights in memory; the build's one weights blob is the blob
stage's. With low_memory_mode=ON and Triton's tuning at compile time (which never runs the program),
the weights do not go to the device either: each is a device tensor with no storage there, its
values on the host (cudabuild.backend.lowmem; cudabuild.specs.compile_keeps_weights_on_host).
The stage's digest is the .so's and the table's;
the value names the weights the program held (`lowered_from`).

Where a value does decide code, it stays in the key: inductor writes a 0-d constant into a kernel as
a literal and folds one-element constants (`constant_fold_uniform_value`), so tensors of at most
one element keep their values in the code digest (in our recipes: the scalars the edge lowering
lifts from the program's arithmetic, never a weight). Inductor would also inline 1-D constants of
up to 8 elements (`GraphLowering.can_inline_constant`), which in qwen_moe's tiny size are weights
(`A_log` and `dt_bias`, 4 per linear-attention layer): the compile turns that off, so they stay
constants of the blob and a new checkpoint keeps the code (a load of 4 values instead of literals).
Freezing, runtime constant folding and mkldnn prepacking, the other ways inductor reads weights,
are off in AOTInductor's options here; a .so that folds constants anyway says so in its table and
is never given other weights.

Everything process-global the compile touches is scoped to it and undone afterwards, also on
error: the environment (the inductor cache dir, line-info switches, and on cuda the probed
TRITON_PTXAS_PATH / TORCH_CUDA_ARCH_LIST plan; with a shared Redis, inductor's remote autotune
cache), the fallback-kernel collector, the SDPA backend choice, and with low_memory_mode=ON the
KV-freeing device move and the CPU-clone patches (cudabuild.backend.lowmem). They are listed, in
the order they must nest, in one place: `compile_scope`. Device memory the method held is
released before returning, so the next method starts from an empty device.

Reproducibility: each compile runs in a private inductor dir whose absolute path is a function of
the action key (`$CUDABUILD_INDUCTOR_DIR/<key>`), emptied first. Inductor embeds that path in the
generated wrapper, so the same inputs compile in the same place on every machine, and nothing a
previous compile left there leaks in; compiled Triton kernels alone come from the cache shared by
all compiles (cudabuild.backend.kernel_cache), which Triton keys by their content. Line tables and Triton line info, which embed source paths,
are off. Tuning decisions are restored before compiling (pinned, or from an earlier compile with
the same tuning key) and harvested afterwards (cudabuild.backend.tuning).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any, Iterable, Iterator

from cudabuild.backend import aoti_constants, benchmark_lock, cpp_objects, device_peak, inductor_phases, vec_isa
from cudabuild.backend.aoti_options import aoti_options, with_custom_shims
from cudabuild.backend.cuda_env import scoped_environ
from cudabuild.errors import CompileFailed, one_line
from cudabuild.specs import compile_keeps_weights_on_host, times_kernels
from cudabuild.backend.fallbacks import check_cuda_fallbacks, collect_fallbacks
from cudabuild.engine.hashing import digest, sha256_file
from cudabuild.backend import mapped_weights
from cudabuild.backend import custom_ops, kernel_cache
from cudabuild.backend.programs import StoredWeights, load_program, program_tensors
from cudabuild.backend.stages.export import release_model
from cudabuild.engine import workers
from cudabuild.engine.context import StageResult
from cudabuild.backend.toolchain import inductor_root
from cudabuild.engine.console.trace import phase
from cudabuild.backend import tuning

def inductor_dir_for(key: str) -> Path:
    return Path(inductor_root()) / key[:20]


def compile_environment(target: str, toolchain: dict, cache_dir: Path, store_root: Path | None = None) -> dict[str, str]:
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "AOT_INDUCTOR_ENABLE_LINE_TABLES": "0",
        "TRITON_DISABLE_LINE_INFO": "1",
    }
    if store_root is not None:
        env.update(kernel_cache.environment(store_root))  # compiled Triton kernels, shared (by content)
    if target == "cuda":
        env.update((toolchain.get("cuda") or {}).get("env") or {})
    # With a read-write CUDABUILD_REMOTE=redis://..., inductor's own autotune cache shares kernel
    # tuning through the same Redis (these variables are outside the toolchain fingerprint).
    env.update(kernel_cache.remote_autotune_environment())
    return env


def user_input_values(ep) -> tuple:
    names = set(ep.graph_signature.user_inputs)
    return tuple(n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in names)


@contextlib.contextmanager
def _inductor_dir_lock(cache_dir: Path):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir.parent / (cache_dir.name + ".lock"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes, or the process dies
        yield


@contextlib.contextmanager
def compile_scope(ep, *, target: str, environment: dict[str, str], low_memory: bool,
                  mapped: Iterable = (), timing_lock: Path | None = None,
                  store_root: Path | None = None, tier=None,
                  weights_on_device: bool = True) -> Iterator[tuple[Any, set, Any, Any]]:
    """Every process-wide change one compile makes, in one list: entered in this order, undone in
    reverse, also on error. Yields the program on the compile's device, the set that collects
    the fallback kernels the compile emits, the count of CPU ISA probes it asked
    (cudabuild.backend.vec_isa; None without a `store_root`) and what its C++ objects were
    (cudabuild.backend.cpp_objects).

    The order, and why:
    1. The environment, outermost: inductor and Triton read the cache dir, the line-info switches
       and the cuda plan while they compile, so it encloses everything below and is put back last.
    2. Inductor's remote autotune cache flag, only where the environment turns that cache on: it
       stands in for a variable inductor's config read once, when it was imported. Beside it, with
       a `store_root`, the CPU ISA probes remembered there (cudabuild.backend.vec_isa), inside the
       environment because torch's probes build with the compiler that environment names.
    3. The program on the device (`_program_on_device`; its weights left on the host where
       `weights_on_device` is False): moved before the patches below are installed, so the move
       runs with stock inductor and with autograd on, as it always has; and it must precede the
       low-memory patches, which recognise the KV caches and the weights by the freed storage
       the move leaves. Its device storage is released once those patches are undone.
    4. The fallback-kernel collector, no_grad and the SDPA math kernel: the state aot_compile
       traces and lowers the program under; no inlining of small 1-D constants (see the module
       docstring), and the C++ compiles of AOTInductor's sources through the object cache
       (cudabuild.backend.cpp_objects, with the shared `tier` where there is one).
    5. With low_memory, lowmem's CPU-clone patches (after the move: see 3).
    6. The timeline spans, innermost, around inductor's own work only; beside them, the release
       of the `mapped` weights' pages as inductor copies them into the weights blob
       (cudabuild.backend.mapped_weights), which concerns that copy alone; and, with a
       `timing_lock`, each GPU benchmark held alone against other processes on the device
       (cudabuild.backend.benchmark_lock), which concerns the timings alone.
    Each patch saves the attribute it replaces and puts it back on exit; undoing them in reverse
    (ExitStack's order) is what keeps that right wherever two of them patch the same object.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cudabuild.backend import lowmem

    with contextlib.ExitStack() as scope:
        scope.enter_context(scoped_environ(environment))
        if environment.get("TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE") == "1":
            from torch._inductor import config as inductor_config

            scope.enter_context(inductor_config.patch(autotune_remote_cache=True))
        probes = scope.enter_context(vec_isa.answered(store_root))
        ep = scope.enter_context(_program_on_device(ep, target, low_memory, weights_on_device))
        fallbacks = scope.enter_context(collect_fallbacks())
        scope.enter_context(torch.no_grad())
        # SDPA left in the graph (triton_kernel_mode=OFF) must decompose: force the math kernel.
        scope.enter_context(sdpa_kernel([SDPBackend.MATH]))
        scope.enter_context(_no_inlined_constants())
        objects = scope.enter_context(cpp_objects.cached(store_root, tier))
        if low_memory:
            scope.enter_context(lowmem.compile_time_cpu_clones(torch.device(_device_of(target))))
        scope.enter_context(inductor_phases.traced())
        scope.enter_context(mapped_weights.released_after_copy(mapped))
        scope.enter_context(benchmark_lock.timings_alone(timing_lock))
        yield ep, fallbacks, probes, objects


@contextlib.contextmanager
def _no_inlined_constants() -> Iterator[None]:
    """Inductor writes a 1-D constant of up to 8 elements into its kernels as literals; within the
    block it keeps every such constant a constant (of the weights blob), so a weight's value never
    decides the compiled code (the module docstring)."""
    from torch._inductor.graph import GraphLowering

    if "can_inline_constant" not in GraphLowering.__dict__:  # another torch: its inlining stays, keyed by value
        yield
        return
    original = GraphLowering.__dict__["can_inline_constant"]
    GraphLowering.can_inline_constant = staticmethod(lambda t: False)
    try:
        yield
    finally:
        GraphLowering.can_inline_constant = original


@contextlib.contextmanager
def _program_on_device(ep, target: str, low_memory: bool, weights_on_device: bool = True) -> Iterator[Any]:
    """`ep` moved to the target's device (KV caches freed with low_memory, and the weights left on
    the host without `weights_on_device`); its device storage is released on exit, so the next
    method starts from an empty device."""
    from cudabuild.backend import lowmem

    ep = lowmem.move_program_to_device(ep, _device_of(target), low_memory=low_memory,
                                       weights_on_device=weights_on_device)
    try:
        if target == "cuda":
            from executorch.backends.cuda.passes.move_cond_predicate_to_cpu import MoveCondPredicateToCpuPass

            MoveCondPredicateToCpuPass()(ep)
        yield ep
    finally:
        lowmem.release_device_tensors(ep)


def _device_of(target: str) -> str:
    return "cuda" if target == "cuda" else "cpu"


def run(ctx) -> StageResult:
    method = ctx.stage.method
    lowered_from = (ctx.upstream("edge", method).value or {}).get("lowered_from")
    return compile_program(ctx, lambda mapped: load_program(ctx.reader("edge", method), mapped),
                           key=ctx.key, graph=ctx.inputs["graph"], lowered_from=lowered_from)


def compile_program(ctx, load, *, key: str, graph: str, lowered_from: str | None, keep_blob: bool = False) -> StageResult:
    """Compile the method's program that `load(mapped)` gives (its weights mapped into `mapped`) as
    the compile stage of key `key` does: in that key's inductor dir, so the bytes are the stage's,
    whichever stage calls it (the blob stage too, when it must compile). `graph` keys the tuning
    decisions; `lowered_from` names the weights the program holds (the value says so). AOTInductor's
    weights blob is held in memory, to prove the constant table on, and not written, unless
    `keep_blob` (the blob stage's own compile, where the table cannot be trusted): then it is the
    output `weights.blob`."""
    with _inductor_dir_lock(inductor_dir_for(key)):
        return _compile(ctx, load, key, graph, lowered_from, keep_blob)


def _compile(ctx, load, key: str, graph: str, lowered_from: str | None, keep_blob: bool) -> StageResult:
    import torch

    method, target = ctx.stage.method, ctx.config.target
    specs = dict(ctx.config.specs[method])
    toolchain = ctx.upstream("probe").value
    low_memory = specs.get("low_memory_mode") == "ON"
    device = _device_of(target)
    cache_dir = inductor_dir_for(key)
    environment = compile_environment(target, toolchain, cache_dir, ctx.cache_root)
    if device == "cuda":  # its workers come up while the program loads and lowers
        with phase("start compile workers", min_seconds=0.05), scoped_environ(environment):
            inductor_phases.start_compile_workers()
    with phase("setup", min_seconds=0.05):
        release_model()
        mapped = StoredWeights()
        custom_ops.register(ctx.config.target)  # the ops its programs call (importing their kernels)
    with phase("load"):
        ep = load(mapped)  # weights mapped from the store, not read
    tensors = program_tensors(ep)  # on the CPU, as the store holds them: what the blob must hold
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    tuning_key, source = _restore_tuning(ctx, cache_dir, toolchain, specs, graph)

    device_peak.start(device)  # this method's compile's peak device memory
    options = with_custom_shims(aoti_options(specs, target, toolchain))
    # Another compile may share the GPU (cudabuild.engine.workers): kernels are timed one at a time.
    timing_lock = workers.timing_lock(ctx.cache_root / "locks", device) if device == "cuda" else None
    with compile_scope(ep, target=target, environment=environment, low_memory=low_memory,
                       mapped=mapped.tensors(), timing_lock=timing_lock, store_root=ctx.cache_root,
                       tier=ctx.shared_tier, weights_on_device=not compile_keeps_weights_on_host(specs, target)) \
            as (ep, fallbacks, probes, objects):
        with phase("AOTInductor") as span, aoti_constants.captured_table(keep_out=not keep_blob) as table:
            kernels_before, entries_before = inductor_phases.kernel_counts(), kernel_cache.entries(ctx.cache_root)
            try:
                paths = torch._inductor.aot_compile(ep.module(), user_input_values(ep), options=options)
            except Exception as e:
                # The one line names the failure; the stage's log keeps where inductor raised it.
                traceback.print_exc(file=sys.stderr)
                raise CompileFailed(f"method {method}: AOTInductor compile failed: {one_line(e)}") from e
            span.update(inductor_phases.since(kernels_before), **inductor_phases.compile_parallelism(),
                        triton_kernels_compiled=len(kernel_cache.entries(ctx.cache_root) - entries_before),
                        cpp_objects_cached=objects.cached + objects.fetched, cpp_objects_compiled=objects.compiled)
        if target == "cuda":
            check_cuda_fallbacks(method, fallbacks, autotuned=times_kernels(specs, target))
        used = sorted(fallbacks)
        # The table, proven on what AOTInductor's blob would have held (or, with keep_blob, on
        # that blob): what lets the blob stage write the blob. Inside the scope: a source may be
        # on the device, whose storage the scope releases on leaving.
        with phase("constant table"):
            blob = next((p for p in paths if isinstance(p, str) and p.endswith(".wrapper_weights.blob")), None)
            if not table:
                problem = "AOTInductor reported no constant table"
            elif keep_blob:
                problem = aoti_constants.blob_problem(blob, dict(table), tensors) if blob else "AOTInductor wrote no weights blob"
            else:
                problem = aoti_constants.source_problem(dict(table), table.sources, tensors)
            table.sources = {}

    so = next((p for p in paths if isinstance(p, str) and p.endswith(".wrapper.so")), None)
    if so is None or (keep_blob and blob is None):
        raise CompileFailed(f"method {method}: AOTInductor produced no .so/weights blob pair: {paths}")
    files = {"model.so": ctx.workdir / "model.so"}
    shutil.move(so, files["model.so"])
    if keep_blob:
        files["weights.blob"] = ctx.workdir / "weights.blob"
        shutil.move(blob, files["weights.blob"])
    files["constants.json"] = _write_json(ctx.workdir / "constants.json", dict(table))
    decisions = tuning.harvest(cache_dir)
    if decisions and source != "pinned":
        ctx.keep_document(f"tune:{tuning_key}", {"files": decisions})
    if not os.environ.get("CUDABUILD_KEEP_INDUCTOR"):
        shutil.rmtree(cache_dir, ignore_errors=True)
    files["autotune.json"] = _write_json(ctx.workdir / "autotune.json", {"tuning_key": tuning_key, "source": source, "files": decisions})
    report = {"fallback_kernels": used, "options": {k: v for k, v in options.items() if isinstance(v, (bool, str, int))}}
    files["compile.json"] = _write_json(ctx.workdir / "compile.json", report)
    shas = {name: sha256_file(files[name]) for name in files if name in ("model.so", "constants.json", "weights.blob")}
    value = {"fallback_kernels": used, "autotune": source, "decisions": len(decisions), "lowered_from": lowered_from,
             "constants": {"rewritable": problem is None, **({"why": problem} if problem else {})},
             "cpp_objects": {"cached": objects.cached, "fetched": objects.fetched, "compiled": objects.compiled}}
    value.update(device_peak.peak(device))
    if probes is not None:  # CPU ISA probes answered from the cache / run by torch
        value["isa_probes"] = {"remembered": probes.remembered, "checked": probes.checked}
    # Downstream depends on the code and its constant table, not on the weights in the blob beside
    # them, nor on the tuning timings.
    regions = {"weights.blob": aoti_constants.table_regions(dict(table) if table else None)} if keep_blob else {}
    return StageResult(files, digest=digest({n: shas[n] for n in ("model.so", "constants.json")}), value=value,
                       known=shas, regions=regions)


def _write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value, indent=1, sort_keys=True))
    return path


def _restore_tuning(ctx, cache_dir: Path, toolchain: dict, specs: dict, graph: str) -> tuple[str, str]:
    """Put earlier decisions in place; returns (tuning key, where they came from)."""
    config, method = ctx.config, ctx.stage.method
    key = tuning.tuning_key(graph, toolchain, specs)
    entry = tuning.pinned(config.project, config.model, config.target, method)
    if entry:
        tuning.restore(cache_dir, entry["files"])
        return key, "pinned"
    stored = ctx.document(f"tune:{key}")
    if stored and stored.get("files"):
        tuning.restore(cache_dir, stored["files"])
        return key, "replayed"
    return key, "tuned" if times_kernels(specs, config.target) else "none"

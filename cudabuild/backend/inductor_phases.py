"""Timeline spans for where an AOTInductor compile's time goes, from inductor's own timers.

Inductor times its phases itself: every `dynamo_timed` block (lowering, scheduling, kernel and
wrapper codegen, Triton's async compile and the wait for it, benchmarking, the C++ compile of the
wrapper and kernels) is reported to torch's `ChromiumEventLogger` with its start and end. Within
`traced()`, each such event of at least MIN_SECONDS becomes a span of the running compile stage,
under a readable name (`PHASES`; an unlisted event keeps inductor's name), so the spans follow
torch's own instrumentation rather than a list of patched functions. The one phase inductor does
not time is wrapped here: template autotuning (`AlgorithmSelectorCache.__call__`, each choice
selected by benchmark).

The compile's Triton kernels are counted too (`kernel_counts`, `since`): compiled, and found in Triton's
cache. Where this torch lacks one of these entry points, that part is just not shown: the timeline
is a diagnostic and must never fail a compile. Backend half.

Inside the C++ compile, inductor runs other tools it does not time one by one (on some torch
versions: `nvcc -fatbin` for each kernel, `ld` and `objcopy` to embed each cubin). Every external
command the stage's process runs through `subprocess` becomes a `tool <name>` span, so that part of
the C++ compile is named by the program that took it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import subprocess
from typing import Iterator

from cudabuild.engine.console.trace import phase, recording

MIN_SECONDS = 0.005
# An external tool's run is kept however short: a hundred 3 ms `objcopy` runs are 0.3 s.
TOOL_MIN_SECONDS = 0.0
# A tool span keeps the start of its command line: enough to tell one `python3 -c` from another.
TOOL_COMMAND_CHARS = 200

# Inductor's event names -> the span's name in trace.json.
PHASES = {
    "_recursive_pre_grad_passes": "pre-grad passes",
    "_recursive_joint_graph_passes": "joint-graph passes",
    "_recursive_post_grad_passes": "post-grad passes",
    "create_aot_dispatcher_function": "AOT dispatch trace",
    "GraphLowering.run": "lowering",
    "Scheduler.__init__": "scheduling",
    "Scheduler.codegen": "kernel codegen",
    "PythonWrapperCodegen.generate": "wrapper codegen",
    "CppWrapperCpu.generate": "wrapper codegen",
    "CppWrapperGpu.generate": "wrapper codegen",
    "async_compile.precompile": "Triton precompile",
    "async_compile.wait": "Triton compile wait",
    "benchmark_fused_nodes": "benchmarking",
    "benchmark_codegened_module": "benchmarking",
    "CachingAutotuner.benchmark_all_configs": "benchmarking",
    "CachingAutotuner.coordinate_descent_tuning": "coordinate descent tuning",
    "AotCodeCompiler.compile": "C++ compile",
    "compile_file": "C++ compiler run",
    "aoti_compile_fatbin": "fatbin compile",
    "aoti_serialize_constants": "weights serialisation",
    "aoti_precompile_header": "precompiled header",
}


def _patched_functions() -> list[tuple[object, str, str]]:
    """(owner, attribute, span name) of the functions timed here because inductor does not."""
    found = []
    with contextlib.suppress(ImportError):
        from torch._inductor.select_algorithm import AlgorithmSelectorCache

        found.append((AlgorithmSelectorCache, "__call__", "autotune"))
    return [(owner, name, span) for owner, name, span in found if name in vars(owner)]


def _timed(function, span: str, bound_to_class: bool):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with phase(span, min_seconds=MIN_SECONDS):
            return function(*args, **kwargs)

    return classmethod(wrapper) if bound_to_class else wrapper


@contextlib.contextmanager
def _inductor_events() -> Iterator[None]:
    """Inductor's timed events, while the block runs, as spans of the stage recorded here."""
    recorder = recording()
    try:
        from torch._dynamo.utils import ChromiumEventLogger
    except ImportError:
        ChromiumEventLogger = None
    if recorder is None or ChromiumEventLogger is None or "log_event_end" not in vars(ChromiumEventLogger):
        yield
        return
    original = vars(ChromiumEventLogger)["log_event_end"]

    @functools.wraps(original)
    def log_event_end(self, event_name, time_ns, metadata, start_time_ns, *args, **kwargs):
        with contextlib.suppress(Exception):  # never fail a compile for the timeline's sake
            if time_ns - start_time_ns >= MIN_SECONDS * 1e9:
                recorder.complete(PHASES.get(event_name, event_name), start_time_ns / 1e3, time_ns / 1e3,
                                  "inductor", event=event_name)
        return original(self, event_name, time_ns, metadata, start_time_ns, *args, **kwargs)

    ChromiumEventLogger.log_event_end = log_event_end
    try:
        yield
    finally:
        ChromiumEventLogger.log_event_end = original


def kernel_counts() -> dict[str, int]:
    """Triton kernels this process's inductor asked for so far, and those of them that were the
    source of one asked for before (compiled once). `since(kernel_counts())` gives a block's. How
    many were compiled rather than found in Triton's cache, inductor does not know:
    kernel_cache.entries does."""
    with contextlib.suppress(ImportError):
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return {"triton_kernels": int(inductor["async_compile_cache_miss"]),
                "triton_kernels_repeated": int(inductor["async_compile_cache_hit"])}
    return {}


def since(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in kernel_counts().items()}


def tool_name(args) -> str:
    """The program a subprocess call runs: `nvcc` for ["/usr/local/cuda/bin/nvcc", ...] and for
    "nvcc -fatbin ..." (a shell string)."""
    with contextlib.suppress(Exception):
        if isinstance(args, (str, bytes)):
            args = shlex.split(os.fsdecode(args))
        first = os.fsdecode(list(args)[0])
        return os.path.basename(first) or first
    return "?"


def tool_command(args, limit: int = TOOL_COMMAND_CHARS) -> str:
    """The command line a subprocess call runs, cut to `limit` characters: what tells one `python3`
    a compile starts from another."""
    with contextlib.suppress(Exception):
        line = os.fsdecode(args) if isinstance(args, (str, bytes)) else shlex.join(os.fsdecode(a) for a in args)
        return line if len(line) <= limit else line[:limit - 3] + "..."
    return "?"


@contextlib.contextmanager
def _tool_spans() -> Iterator[None]:
    """Each `subprocess.run` / `subprocess.call` of this process, while the block runs, as a span
    named after its program (check_output and check_call go through these two)."""
    recorder = recording()
    if recorder is None:
        yield
        return
    originals = {name: getattr(subprocess, name) for name in ("run", "call")}

    def timed(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            command = args[0] if args else kwargs.get("args")
            # The recorder itself, not the context's: inductor runs some tools from a thread pool.
            with recorder.span(f"tool {tool_name(command)}", category="tool", min_seconds=TOOL_MIN_SECONDS,
                               command=tool_command(command)):
                return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(subprocess, name, timed(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(subprocess, name, original)


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Within the block, inductor's phases appear as spans of the running stage."""
    originals = []
    for owner, name, span in _patched_functions():
        raw = vars(owner)[name]
        is_classmethod = isinstance(raw, classmethod)
        function = raw.__func__ if is_classmethod else raw
        originals.append((owner, name, raw))
        setattr(owner, name, _timed(function, span, is_classmethod))
    try:
        with _inductor_events(), _tool_spans():
            yield
    finally:
        for owner, name, raw in reversed(originals):
            setattr(owner, name, raw)


# Spans that enclose a compile's phases rather than being one: the runner's, the compile stage's
# own, and inductor's outer drivers. Time inside them but outside every other span has no name.
ENCLOSING = frozenset({
    "admitted", "run", "AOTInductor", "compile_fx_aot", "compile_fx.<locals>.fw_compiler_base", "inductor_compile",
    "fx_codegen_and_compile", "compile_fx_inner", "_compile_fx_inner", "GraphLowering.compile_to_fn",
    "GraphLowering.compile_to_module", "GraphLowering.codegen",
})


def named_share(events: list[dict], stage: dict) -> float:
    """The share of `stage`'s span (a trace.json event) that lies inside a named phase: any span of
    its process within it, other than the ENCLOSING ones."""
    start, end = stage["ts"], stage["ts"] + stage["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e is not stage and e.get("pid") == stage.get("pid")
                   and e.get("cat") != "stage" and e["name"] not in ENCLOSING
                   and e["ts"] >= start and e["ts"] + e["dur"] <= end)
    covered, reach = 0.0, start
    for a, b in spans:
        a = max(a, reach)
        if b > a:
            covered, reach = covered + b - a, b
    return covered / stage["dur"] if stage["dur"] else 1.0


def compile_parallelism() -> dict:
    """How inductor compiled this process's kernels: its compile_threads (the cores it may use),
    and whether its worker pool came up. AOT compiles do not warm the pool as torch.compile does,
    and until the pool answers, inductor compiles Triton kernels one by one in this process."""
    from torch._inductor import async_compile, config

    threads = async_compile.get_compile_threads() if hasattr(async_compile, "get_compile_threads") else config.compile_threads
    if not hasattr(async_compile.AsyncCompile, "_ready_future"):  # a private name another torch may not have
        return {"compile_threads": threads, "compile_workers": "unknown"}
    ready = async_compile.AsyncCompile._ready_future
    return {"compile_threads": threads,
            "compile_workers": "pool" if ready is not None and ready.done() else "in-process"}


def start_compile_workers() -> bool:
    """Start inductor's compile-worker pool now, as torch.compile does before it traces
    (`maybe_warm_pool`); returns whether a pool is starting or up.

    aot_compile starts none: the first Triton kernel asks for the pool, and until its workers
    answer a probe job, every kernel is compiled one by one in this process. Started when the
    stage starts, the workers come up while the program loads and inductor lowers it. Call it
    inside the compile's environment: the workers inherit the variables of the moment they are
    created (TRITON_PTXAS_PATH, TRITON_CACHE_MANAGER; inductor re-sends only the cache dirs with
    each job). A pool already up (an earlier compile in this process) is kept as it is. Never
    fails a compile: where this torch lacks the entry points, nothing starts."""
    try:
        from torch._inductor import async_compile
        from torch.utils._triton import has_triton_package

        if not has_triton_package():
            return False
        async_compile.AsyncCompile.warm_pool()
        async_compile.AsyncCompile.wakeup()
        return getattr(async_compile.AsyncCompile, "_ready_future", None) is not None
    except Exception:  # a diagnostic aid: the compile goes on with the in-process path
        return False

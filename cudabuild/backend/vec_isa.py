"""Inductor's CPU vector-ISA probes, each built and loaded once per machine and toolchain, not once
per compile.

Before inductor compiles any C++ (on cuda too: the wrapper's build options name a CPU ISA), it
probes each ISA the CPU's flags list, and some of their features (AVX-512 bf16, AMX, AMX-fp16):
a probe is a small library built with that ISA's flags and loaded in a child Python that imports
torch (`VecISA.check_build`). torch keeps the answers for the process only, and every cudabuild
compile runs in a fresh worker with an emptied inductor dir. So every compile built the probes and
started those children again: on the H200, four probes of 1.5-1.7 s of g++ and 3.4-4.9 s of child
Python each, about 23 s of every compile stage (trace.json's `tool g++` / `tool python3` spans).

A probe's answer is remembered in the cache (`vec_isa/<machine>/<probe>.json`), and a later
compile on the same machine takes it without building or loading anything. The machine key covers
the torch build, the C++ compiler (path, size, mtime) and the CPU's flags; the probe key adds the
ISA, the probe's source and its whole build command as inductor's config makes it at that moment
(compiler, defines, include dirs, flags, libraries). That last part matters: ExecuTorch's CUDA
lowering sets `aot_inductor.link_libtorch=False`, so its probes link no libtorch and fail to load
(`undefined symbol: Sleef_expf16_u10`), in the stock exporter too, while a CPU compile's probes pass;
each keeps its own answer. A failure is usually as repeatable as a pass (a compile error, a missing
symbol), but a full disk or a killed compiler fails a probe once, and a failure kept for good would
turn an ISA off on that machine. So a pass is kept at once, and a failure is taken as the answer
once torch's check has given it in two compiles (`FAILURES_TO_KEEP`); a load that timed out (torch
2.13 warns that the probe "hung") is never counted. Only torch's own check ever records
an answer, and a probe's only effect is its answer (the library it builds is used for nothing
else), so a compile and its bytes are what they were. `$TORCHINDUCTOR_VEC_ISA_OK` (inductor's own
switch) wins over all of this.

Where the answers are not known yet (a fresh cache), the probes run side by side and ahead of
need. Torch asks them one after another when the C++ compile starts, at the end of the compile;
on the H200 that was four failing probes of 4.5-5.7 s each, in sequence, in each compile. So as
soon as inductor starts lowering (its config, with the compile's options, then in force), the
first probe of every ISA the CPU lists starts in a thread of its own, and torch's check later
takes the answer when it asks the same question (same ISA, source and build command). An answer
found while the build command was changing is not used nor kept: torch asks again itself.
(On 2 cores, CPU target: a cold tiny_lm build in 0.935 of the time, the other compile finding
the passes kept before it asked.)
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import re
import sys
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from shutil import which
from typing import Iterator, Optional

from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.hashing import digest

FOLDER = "vec_isa"
FAILURES_TO_KEEP = 2  # compiles in which torch's check failed a probe before the failure is its answer
# torch 2.13 warns this when it gave up loading a probe: its False then says nothing of the machine.
HUNG_WARNING = r"VecISA dlopen probe .* hung"


@dataclass
class ProbeCount:
    """What one block asked: probes answered from the cache, and probes torch ran."""

    remembered: int = 0
    checked: int = 0


def machine_key() -> Optional[str]:
    """What decides every probe here, or None where there is nothing to save (not x86-64: torch
    probes nothing by building there)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    import torch
    from torch._inductor import cpp_builder, cpu_vec_isa

    compiler = cpp_builder.get_cpp_compiler()
    located = compiler if os.path.isabs(compiler) else which(compiler)
    stat = Path(located).resolve().stat() if located and Path(located).exists() else None
    return digest({
        "torch": torch.__version__, "torch_file": torch.__file__,
        "compiler": [str(Path(located).resolve()), stat.st_size, stat.st_mtime_ns] if stat else compiler,
        "cpu_flags": sorted(cpu_vec_isa.x86_isa_checker()),
    })


def _arch_flags(isa) -> str:
    """The flags this probe builds with (a feature probe adds to the ISA's flags for its build)."""
    build_flags = getattr(isa, "build_arch_flags", None)
    return build_flags() if callable(build_flags) else str(getattr(isa, "_arch_flags", ""))


def _build_command(isa) -> dict:
    """What a probe's build is made of under inductor's config now (as torch's check builds it)."""
    from torch._inductor.cpp_builder import CppTorchOptions

    options = CppTorchOptions(vec_isa=isa, warning_all=False)
    parts = ("compiler", "definitions", "include_dirs", "cflags", "ldflags", "libraries_dirs", "libraries",
             "passthrough_args")
    return {part: getattr(options, f"get_{part}")() for part in parts if hasattr(options, f"get_{part}")}


def probe_path(store_root: Path, machine: str, isa, code: str) -> Path:
    """Where a probe's pass is kept; each failure is a file beside it (`<probe>.failed-<id>.json`)."""
    probe = digest({"isa": type(isa).__name__, "flags": _arch_flags(isa), "code": code, "build": _build_command(isa)})
    return Path(store_root) / FOLDER / machine[:32] / f"{probe[:32]}.json"


def _known_answer(path: Path) -> Optional[bool]:
    if path.is_file():
        return True
    failures = list(path.parent.glob(f"{path.stem}.failed-*.json")) if path.parent.is_dir() else []
    return False if len(failures) >= FAILURES_TO_KEEP else None


def _remember(path: Path, isa, passed: bool) -> None:
    target = path if passed else path.with_name(f"{path.stem}.failed-{uuid.uuid4().hex[:12]}.json")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, json.dumps({"isa": str(isa), "flags": _arch_flags(isa), "passed": passed}))


class _HangWatch:
    """Which thread's probe load torch gave up on. Torch says so only by a warning, and probes run
    in several threads at once, where `warnings.catch_warnings` (process-wide, and it would undo
    every filter the compile's own imports add) cannot be entered per probe. So one hook, for the
    whole block, notes the warning in the thread that raised it and passes it on as it would have
    been shown; and one filter shows every hang, not the first per source line."""

    def __init__(self):
        self._local = threading.local()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        warnings.filterwarnings("always", message=HUNG_WARNING)
        ours = warnings.filters[0]
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if re.match(HUNG_WARNING, str(message)):
                self._local.hung = True
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        try:
            yield
        finally:
            if warnings.showwarning is showwarning:
                warnings.showwarning = shown
            with contextlib.suppress(ValueError):
                warnings.filters.remove(ours)
                getattr(warnings, "_filters_mutated", lambda: None)()  # forget what was decided with it

    def start(self) -> None:
        self._local.hung = False

    def hung(self) -> bool:
        return getattr(self._local, "hung", False)


@contextlib.contextmanager
def answered(store_root: Optional[Path]) -> Iterator[Optional[ProbeCount]]:
    """Within the block, a probe whose answer this machine knows (same source, same build command)
    gets it without being built or loaded, the answer of a probe torch runs is remembered, and
    once inductor starts lowering, the probes not known yet start side by side (module docstring).
    Yields the block's counts (None where nothing is remembered: no store, not x86-64, or the
    user's `$TORCHINDUCTOR_VEC_ISA_OK`)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    machine = machine_key() if store_root is not None and inductor_config.cpp.vec_isa_ok is None else None
    if machine is None:
        yield None
        return
    count, counting = ProbeCount(), threading.Lock()
    torch_check = cpu_vec_isa.VecISA.check_build
    hangs = _HangWatch()
    ahead: dict[Path, Future] = {}
    ahead_started = threading.Event()
    listed = _listed(cpu_vec_isa)
    pool = ThreadPoolExecutor(max_workers=max(1, len(listed)), thread_name_prefix="isa-probe")

    def checked_by_torch(isa, code: str, path: Path) -> tuple[bool, bool]:
        """torch's own check: (its answer, whether the question was still `path` when it ended).
        The answer is remembered unless the load hung or the build command changed meanwhile."""
        with counting:
            count.checked += 1
        started = time.monotonic()
        hangs.start()
        passed = torch_check(isa, code)
        # The stage log says which probes torch ran here, and how they ended.
        print(f"cudabuild: CPU ISA probe {isa} [{_arch_flags(isa)}] {'passed' if passed else 'failed'}"
              f" in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        unchanged = probe_path(store_root, machine, isa, code) == path
        if unchanged and not hangs.hung():
            _remember(path, isa, passed)
        return passed, unchanged

    def check_build(isa, code: str) -> bool:
        path = probe_path(store_root, machine, isa, code)
        known = _known_answer(path)
        if known is not None:
            with counting:
                count.remembered += 1
            return known
        early = ahead.pop(path, None)
        if early is not None:
            with contextlib.suppress(Exception):  # a probe that raised in its thread is asked here again
                passed, unchanged = early.result()
                if unchanged:
                    return passed
        return checked_by_torch(isa, code, path)[0]

    def probe_ahead() -> None:
        """Start the first probe of each listed ISA whose answer is not known, each in a thread;
        once a block (inductor lowers subgraphs too, under the same config)."""
        if ahead_started.is_set():
            return
        ahead_started.set()
        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return  # this process asked already (a worker's earlier compile): torch will not ask again
        code = cpu_vec_isa.VecISA._avx_code
        for isa in listed:
            path = probe_path(store_root, machine, isa, code)
            if path not in ahead and _known_answer(path) is None:
                ahead[path] = pool.submit(checked_by_torch, isa, code, path)

    with hangs.installed(), _before_lowering(probe_ahead):
        cpu_vec_isa.VecISA.check_build = check_build
        try:
            yield count
        finally:
            cpu_vec_isa.VecISA.check_build = torch_check
            pool.shutdown(wait=True, cancel_futures=True)  # none outlives the compile's environment


def _listed(cpu_vec_isa) -> list:
    """The ISAs torch probes on this CPU: those whose every flag the CPU lists (as torch picks them)."""
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


@contextlib.contextmanager
def _before_lowering(hook) -> Iterator[None]:
    """Within the block, `hook()` runs each time inductor starts lowering a graph, inside the
    compile's config. Where this torch's GraphLowering has no `run`, it never runs."""
    try:
        from torch._inductor.graph import GraphLowering
    except ImportError:
        GraphLowering = None
    original = vars(GraphLowering).get("run") if GraphLowering is not None else None
    if original is None:
        yield
        return

    @functools.wraps(original)
    def run(self, *args, **kwargs):
        with contextlib.suppress(Exception):  # only ever a head start: torch's check asks regardless
            hook()
        return original(self, *args, **kwargs)

    GraphLowering.run = run
    try:
        yield
    finally:
        GraphLowering.run = original

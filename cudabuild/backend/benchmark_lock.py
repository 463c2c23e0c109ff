"""Inductor's kernel timings on a shared GPU, one at a time across processes.

Two compiles may share one GPU (cudabuild.engine.workers admits them by device memory), but a
kernel timed while another process's kernels run is timed wrong, and the tuning decision taken
from it is kept and replayed. So within `timings_alone(lock_file)`, every GPU benchmark inductor
runs (template autotuning, Triton config tuning) holds `lock_file` exclusively for its duration;
everything else in the compile goes on beside the other process.

Where torch offers the hook for this (`set_gpu_benchmark_lock_context`, torch 2.13) it is used;
on an older torch the benchmarker's GPU entry points are wrapped for the block instead. Both are
put back on exit. The lock is re-entrant within a process, because inductor's benchmark helpers
call one another, and a second flock on the same file from one process would wait on itself.
Backend half.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import threading
from pathlib import Path
from typing import Iterator

from cudabuild.engine.console import trace

# The benchmarker's methods that run kernels on the GPU to time them (an older torch's names).
GPU_ENTRY_POINTS = ("benchmark_gpu", "benchmark_gpu_with_cuda_graph")


class ProcessLock:
    """An exclusive flock on a file, re-entrant within this process."""

    def __init__(self, lock_file: Path):
        self.lock_file = Path(lock_file)
        self._guard = threading.RLock()
        self._depth = 0
        self._handle = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._guard:
            if self._depth == 0:
                self.lock_file.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.lock_file, "a+")
                # Named in the trace where it is long enough to matter (a compile times hundreds).
                with trace.wait("wait: timing lock", min_seconds=0.05):
                    fcntl.flock(self._handle, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._handle, fcntl.LOCK_UN)
                    self._handle.close()
                    self._handle = None


@contextlib.contextmanager
def timings_alone(lock_file: Path | None) -> Iterator[None]:
    """Within the block, each GPU benchmark inductor runs holds `lock_file` alone (None: nothing)."""
    if lock_file is None:
        yield
        return
    lock = ProcessLock(lock_file)
    try:
        from torch._inductor.runtime import benchmarking
    except ImportError:
        yield
        return
    if hasattr(benchmarking, "set_gpu_benchmark_lock_context"):
        previous = benchmarking.set_gpu_benchmark_lock_context(lock.held)
        try:
            yield
        finally:
            benchmarking.set_gpu_benchmark_lock_context(previous)
        return
    instance = getattr(benchmarking, "benchmarker", None)
    wrapped = [name for name in GPU_ENTRY_POINTS if instance is not None and hasattr(instance, name)]
    own = {name: vars(instance)[name] for name in wrapped if name in vars(instance)}
    for name in wrapped:
        setattr(instance, name, _holding(getattr(instance, name), lock))
    try:
        yield
    finally:
        for name in wrapped:
            if name in own:
                setattr(instance, name, own[name])
            else:
                delattr(instance, name)  # the class's method shows through again


def _holding(function, lock: ProcessLock):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with lock.held():
            return function(*args, **kwargs)

    return wrapper

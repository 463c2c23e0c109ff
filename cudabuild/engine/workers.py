"""How many stages a build runs at once, and which stages must run with no other beside them.

The two methods of a recipe are independent chains (export -> edge -> compile), and one stage
mostly keeps one core busy (a C++ compile is one gcc), so `doit export` runs stages in up to
`default_workers()` processes: one per usable core, at most MAX_DEFAULT_WORKERS, or
$CUDABUILD_JOBS; `doit -n N` says it outright (cudabuild.doit_tasks reads it for the admission
below) and `-n 1` builds one stage at a time.

Memory is what parallel stages can run out of: a real checkpoint's stage holds about its weights'
size. So every stage that runs holds an admission lock (one flock per cache, so concurrent builds
on one machine count too): shared when `workers` stages of its size fit in half the memory
available now, exclusive otherwise, or when its size is unknown, or when its pipeline row says it
must run alone (a stage that times kernels on the CPU). Shared holders exclude an exclusive one
and the other way round, so stages that run side by side were each judged to fit `workers` times
over. A stage that uses an accelerator (its row's `device`) also holds that device's lock,
exclusive: one compile or verify on the GPU at a time (its memory, and tuning's timings), while
host-only stages go on beside it. The memory lock is always taken before the device's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.errors import InvalidOption

MAX_DEFAULT_WORKERS = 4
JOBS_ENV = "CUDABUILD_JOBS"
# A stage's peak is its inputs' bytes times this, plus what a process with torch and ExecuTorch
# imported holds (measured: peaks of 1.06x-1.28x a checkpoint's bytes, and about 1 GiB at rest).
INPUT_FACTOR = 1.5
PROCESS_BYTES = 1 << 30
# A stage's last measured peak is taken with this margin (the sampler can miss a short spike).
HISTORY_MARGIN = 1.25
# Of the memory available, what stages side by side may plan to use together. Half: what a
# process keeps after its stage (Python's heap, a worker's imports) is not in the estimates, and
# a checkpoint of a third of the machine's memory is better built one stage at a time (its
# stages' peaks at 1.3x its size, and its pages in the page cache, would not fit twice).
USABLE_FRACTION = 0.5


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(environ: Optional[dict] = None) -> int:
    """$CUDABUILD_JOBS, else one worker per usable core, at most MAX_DEFAULT_WORKERS."""
    environ = os.environ if environ is None else environ
    value = environ.get(JOBS_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise InvalidOption(f"{JOBS_ENV}={value}: expected a whole number of stages to run at once, 1 or more")
        return int(value)
    return max(1, min(usable_cores(), MAX_DEFAULT_WORKERS))


def available_memory() -> Optional[int]:
    """MemAvailable (Linux), lowered to the cgroup's limit less its usage where one is set."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit.isdigit() and used.isdigit():
            room = int(limit) - int(used)
            found = room if found is None else min(found, room)
    except OSError:
        pass
    return found


@dataclass(frozen=True)
class Admission:
    """How a stage is let in: `alone` or not, and why (for the trace and the log)."""

    alone: bool
    why: str


def admission(workers: int, estimate: Optional[int], alone_because: Optional[str],
              available: Optional[int]) -> Admission:
    if workers <= 1:
        return Admission(False, "one stage at a time")
    if alone_because:
        return Admission(True, alone_because)
    if estimate is None:
        return Admission(True, "its memory is not known before it runs")
    if available is None:
        return Admission(True, "this machine does not say how much memory is free")
    if estimate * workers > available * USABLE_FRACTION:
        return Admission(True, f"{workers} stages of ~{estimate / 2**30:.1f} GiB would not fit in "
                               f"{available / 2**30:.1f} GiB free")
    return Admission(False, f"~{estimate / 2**30:.1f} GiB fits {workers} times in {available / 2**30:.1f} GiB free")


@contextlib.contextmanager
def admitted(lock_file: Path, alone: bool) -> Iterator[float]:
    """Hold the admission lock (exclusive when `alone`) around a stage; yields the seconds waited."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+") as handle:
        start = time.monotonic()
        fcntl.flock(handle, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield time.monotonic() - start
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

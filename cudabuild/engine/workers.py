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
over. A stage that uses an accelerator (its row's `device`) also holds that device's lock, by
the same rule for the device's memory (`device_admission`): shared when `workers` stages of its
last measured peak (in a first build, an estimate from its inputs' bytes) fit in the device memory
free now, else exclusive. So two compiles share one GPU
once they are known to fit, and overlap their host-side phases (lowering, codegen, the C++
compile). What must not overlap is the timing of kernels: a stage that benchmarks on the device
takes `timing_lock(device)` around each benchmark alone (cudabuild.backend.benchmark_lock), so
no tuning decision is timed beside another's work. The memory lock is always taken before the
device's, and the timing lock last, inside a stage.
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
# A process that uses the GPU holds its CUDA context and its allocator's slack beyond the bytes
# it allocated (which is what a stage measures as its peak).
DEVICE_PROCESS_BYTES = 1 << 30
# A device stage with no measured peak (a first build) is sized from its inputs: the program and
# weights its upstream stages handed it. Measured on the H200 (ExecuTorch's Qwen3.5-MoE, int4,
# 35b-a3b shapes at 4 layers, 3.2 GB of weights): compile peaks of 1.6x (decode) and 2.1x (prefill)
# those bytes. 3x leaves room for verify, which holds the eager model and the compiled weights,
# and DEVICE_FIRST_RUN_BYTES for a CUDA context, its workspace and autotuning's scratch buffers.
DEVICE_INPUT_FACTOR = 3.0
DEVICE_FIRST_RUN_BYTES = 2 << 30
# Of the device memory free, what stages side by side may plan to use together: no page cache
# or heap competes there, but the caching allocator reserves beyond its peak.
DEVICE_USABLE_FRACTION = 0.8
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
            raise InvalidOption(f"{JOBS_ENV}={value}", expected="a whole number of stages to run at once, 1 or more")
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


def device_admission(workers: int, last_peak: Optional[int], free: Optional[int],
                     from_inputs: Optional[int] = None) -> Admission:
    """Whether a stage that uses the device may share it: `last_peak` is the device bytes the
    stage (or its sibling method) allocated at most in its last run, `free` the device's free
    bytes now, `from_inputs` the bytes its upstream stages handed it (which size a first build's
    stage, DEVICE_INPUT_FACTOR times over, where no peak is measured yet)."""
    if workers <= 1:
        return Admission(False, "one stage at a time")
    if last_peak is None and not from_inputs:
        return Admission(True, "its device memory is not known before it runs")
    if free is None:
        return Admission(True, "the device does not say how much memory is free")
    if last_peak is not None:
        need, basis = int(last_peak * HISTORY_MARGIN) + DEVICE_PROCESS_BYTES, ""
    else:
        need, basis = int(from_inputs * DEVICE_INPUT_FACTOR) + DEVICE_FIRST_RUN_BYTES, " (estimated from its inputs)"
    if need * workers > free * DEVICE_USABLE_FRACTION:
        return Admission(True, f"{workers} stages of ~{need / 2**30:.1f} GiB{basis} would not fit in "
                               f"{free / 2**30:.1f} GiB free on the device")
    return Admission(False, f"~{need / 2**30:.1f} GiB{basis} fits {workers} times in {free / 2**30:.1f} GiB free on the device")


# Behave as on a card of this size (`24GiB`): admission counts the device's free memory as what is
# left of it, and every stage that uses the device caps its allocator there
# (cudabuild.backend.device_peak), so a build shown to pass on an 80 GB card with it passes on a
# 24 GB one. Not keyed: it decides what runs side by side and what fails, not what a stage makes.
DEVICE_MEMORY_ENV = "CUDABUILD_DEVICE_MEMORY"


def device_memory_cap(environ: Optional[dict] = None) -> Optional[int]:
    """$CUDABUILD_DEVICE_MEMORY in bytes, or None when unset."""
    from cudabuild.engine.cache_admin import parse_size

    text = (os.environ if environ is None else environ).get(DEVICE_MEMORY_ENV, "").strip()
    return parse_size(text, DEVICE_MEMORY_ENV) if text else None


def free_device_memory(device: str, environ: Optional[dict] = None) -> Optional[int]:
    """The free bytes of the device a stage for `device` uses (the first of CUDA_VISIBLE_DEVICES),
    from nvidia-smi, so deciding costs no CUDA context in this process; None where it cannot say.
    Under $CUDABUILD_DEVICE_MEMORY, no more than that size less what is in use."""
    import shutil
    import subprocess

    environ = os.environ if environ is None else environ
    if device != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    select = ["-i", visible] if visible else ["-i", "0"]
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,memory.used", "--format=csv,noheader,nounits",
                               *select], capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            return None
        free, used = (int(v.strip()) << 20 for v in done.stdout.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    cap = device_memory_cap(environ)
    return free if cap is None else max(0, min(free, cap - used))


def device_lock(locks: Path, device: str) -> Path:
    return locks / f"device-{device}"


def timing_lock(locks: Path, device: str) -> Path:
    """Held alone around each timing of kernels on `device`, by every stage of every build that
    shares this cache's locks."""
    return locks / f"device-{device}.timing"

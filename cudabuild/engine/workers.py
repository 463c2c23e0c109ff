"""How many stages a build runs at once, and which stages must run with no other beside them.

The two methods of a recipe are independent chains (export -> edge -> compile), and one stage
mostly keeps one core busy (a C++ compile is one gcc), so `doit export` runs stages in up to
`default_workers()` processes: one per usable core, at most MAX_DEFAULT_WORKERS, or
$CUDABUILD_JOBS; `doit -n N` says it outright (cudabuild.doit_tasks reads it for the admission
below) and `-n 1` builds one stage at a time.

Memory is what parallel stages can run out of: a real checkpoint's stage holds about its weights'
size. So every stage that runs reserves its estimated need from the machine's memory budget
(`memory_budget`: USABLE_FRACTION of its memory) in a ledger shared by every build of the cache
(cudabuild.engine.ledger), and is let in when the reservations in flight plus its own fit; it
runs alone when its size is unknown or past the budget, or when its pipeline row says it must (a
stage that times kernels on the CPU). A stage that uses an accelerator (its row's `device`) also
reserves from that device's budget (`device_budget`), by its last measured peak, or in a first
build by its inputs' bytes times its row's factor. So two compiles share one GPU when their
needs fit together, and overlap their host-side phases (lowering, codegen, the C++ compile).
What must not overlap is the timing of kernels: a stage that benchmarks on the device takes
`timing_lock(device)` around each benchmark alone (cudabuild.backend.benchmark_lock), so no
tuning decision is timed beside another's work. The memory budget is reserved before the
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
# A device stage with no measured peak (a first build) is sized from its inputs (the weights its
# upstream stages handed it) times its pipeline row's factor (cudabuild.pipeline), plus this for a
# CUDA context, its workspace and autotuning's scratch buffers.
DEVICE_FIRST_RUN_BYTES = 2 << 30
# Of the device's memory, what stages side by side may plan to allocate together: no page cache
# or heap competes there, but the caching allocator reserves beyond its peak.
DEVICE_USABLE_FRACTION = 0.85
# Of the machine's memory, what stages side by side may plan to hold together: what a process
# keeps after its stage (Python's heap, a worker's imports) is not in the estimates, nor the page
# cache the weights' mapped files live in.
USABLE_FRACTION = 0.7


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


def _meminfo(field: str) -> Optional[int]:
    """A /proc/meminfo field in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_memory(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> tuple[Optional[int], Optional[int]]:
    """(the tightest memory.max of this process's cgroup and its parents, that cgroup's
    memory.current), cgroup v2; Nones where none is set or it cannot say. A build run inside a
    cgroup of its own (`memory.max` as a proof of a 64 GB host, say) is bounded by it, not only the
    container's root."""
    try:
        line = next((l for l in membership.read_text().splitlines() if l.startswith("0::")), None)
    except OSError:
        line = None
    path = (line[3:].strip() if line else "/").strip("/")
    folders = [root / path] + [root / p for p in _parents(path)] if path else [root]
    limits = []
    for folder in folders:
        with contextlib.suppress(OSError, ValueError):
            text = (folder / "memory.max").read_text().strip()
            if text.isdigit():
                limits.append(int(text))
    used = None
    with contextlib.suppress(OSError, ValueError):
        used = int((folders[0] / "memory.current").read_text().strip())
    return (min(limits) if limits else None), used


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def available_memory() -> Optional[int]:
    """MemAvailable (Linux), lowered to the cgroup's limit less its usage where one is set."""
    found = _meminfo("MemAvailable")
    if found is None:
        return None
    limit, used = cgroup_memory()
    if limit is not None and used is not None:
        found = min(found, limit - used)
    return found


@dataclass(frozen=True)
class Admission:
    """How a stage is let in: `alone` or not, why (for the trace and the log), and the bytes it
    reserves of the budget (`need`; None when alone: all of it)."""

    alone: bool
    why: str
    need: Optional[int] = None


def admission(workers: int, estimate: Optional[int], alone_because: Optional[str],
              budget: Optional[int]) -> Admission:
    """A stage's reservation of the machine's memory budget (memory_budget): its estimate, beside
    the others whose reservations leave room for it (cudabuild.engine.ledger); alone when it says
    so, when its memory is not known, or when the machine does not say how much it has."""
    if workers <= 1:
        return Admission(False, "one stage at a time", 0)
    if alone_because:
        return Admission(True, alone_because)
    if estimate is None:
        return Admission(True, "its memory is not known before it runs")
    if budget is None:
        return Admission(True, "this machine does not say how much memory it has")
    if estimate > budget:
        return Admission(True, f"~{estimate / 2**30:.1f} GiB is more than the {budget / 2**30:.1f} GiB stages may use together")
    return Admission(False, f"~{estimate / 2**30:.1f} GiB of the {budget / 2**30:.1f} GiB stages may use together", estimate)


# Behave as on a host of this size (`64GiB`): the stages side by side plan to hold at most
# USABLE_FRACTION of it (cudabuild.engine.ledger). Not keyed: it decides what runs side by side, not
# what a stage makes. A cgroup's memory.max, where the build runs in one, bounds the same way.
HOST_MEMORY_ENV = "CUDABUILD_HOST_MEMORY"


def _size_setting(name: str, environ: Optional[dict]) -> Optional[int]:
    """The size variable `name` (`64GiB`) in bytes, or None when unset."""
    from cudabuild.engine.cache_admin import parse_size

    text = (os.environ if environ is None else environ).get(name, "").strip()
    return parse_size(text, name) if text else None


def host_memory_cap(environ: Optional[dict] = None) -> Optional[int]:
    """$CUDABUILD_HOST_MEMORY in bytes, or None when unset."""
    return _size_setting(HOST_MEMORY_ENV, environ)


def memory_budget(environ: Optional[dict] = None) -> Optional[int]:
    """What the stages of the builds on this machine may hold together: USABLE_FRACTION of its
    memory (the tightest of MemTotal, this process's cgroup's memory.max and $CUDABUILD_HOST_MEMORY),
    or None where it cannot say."""
    sizes = [s for s in (_meminfo("MemTotal"), cgroup_memory()[0], host_memory_cap(environ)) if s]
    return int(min(sizes) * USABLE_FRACTION) if sizes else None


def device_admission(workers: int, last_peak: Optional[int], budget: Optional[int],
                     from_inputs: Optional[int] = None, input_factor: float = 0.0) -> Admission:
    """A stage's reservation of the device's memory budget (device_budget): `last_peak` is the
    device bytes the stage (or its sibling method) allocated at most in its last run; in a first
    build, where there is none, `from_inputs` (the weights its upstream stages handed it) times
    the stage's `input_factor` (its pipeline row's) sizes it."""
    if workers <= 1:
        return Admission(False, "one stage at a time", 0)
    if last_peak is None and not from_inputs:
        return Admission(True, "its device memory is not known before it runs")
    if budget is None:
        return Admission(True, "the device does not say how much memory it has")
    if last_peak is not None:
        need, basis = int(last_peak * HISTORY_MARGIN) + DEVICE_PROCESS_BYTES, "measured"
    else:
        need, basis = int(from_inputs * input_factor) + DEVICE_FIRST_RUN_BYTES, "estimated from its inputs"
    if need > budget:
        return Admission(True, f"~{need / 2**30:.1f} GiB ({basis}) is more than the device's {budget / 2**30:.1f} GiB")
    return Admission(False, f"~{need / 2**30:.1f} GiB ({basis}) of the device's {budget / 2**30:.1f} GiB", need)


# Behave as on a card of this size (`24GiB`): admission counts the device's free memory as what is
# left of it, and every stage that uses the device caps its allocator there
# (cudabuild.backend.device_peak), so a build shown to pass on an 80 GB card with it passes on a
# 24 GB one. Not keyed: it decides what runs side by side and what fails, not what a stage makes.
DEVICE_MEMORY_ENV = "CUDABUILD_DEVICE_MEMORY"


def device_memory_cap(environ: Optional[dict] = None) -> Optional[int]:
    """$CUDABUILD_DEVICE_MEMORY in bytes, or None when unset."""
    return _size_setting(DEVICE_MEMORY_ENV, environ)


def device_capacity(device: str, environ: Optional[dict] = None) -> Optional[int]:
    """What one stage alone may allocate on the device a stage for `device` uses: its memory
    (under $CUDABUILD_DEVICE_MEMORY, that size), less a process's CUDA context and allocator slack
    (DEVICE_PROCESS_BYTES); None where it cannot say. A stage that needs more is refused before it
    starts (cudabuild.engine.admission), rather than failing part way with an out-of-memory error."""
    total = device_total(device, environ)
    return None if total is None else total - DEVICE_PROCESS_BYTES


def device_total(device: str, environ: Optional[dict] = None) -> Optional[int]:
    """The device's memory from nvidia-smi (so deciding costs no CUDA context in this process),
    under $CUDABUILD_DEVICE_MEMORY that size where it is smaller; None where it cannot say."""
    import shutil
    import subprocess

    environ = os.environ if environ is None else environ
    if device != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    select = ["-i", visible] if visible else ["-i", "0"]
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", *select],
                              capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            return None
        total = int(done.stdout.strip().splitlines()[0].strip()) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    cap = device_memory_cap(environ)
    return total if cap is None else min(total, cap)


def device_budget(device: str, environ: Optional[dict] = None) -> Optional[int]:
    """What the stages on the device a stage for `device` uses (the first of CUDA_VISIBLE_DEVICES)
    may allocate together: DEVICE_USABLE_FRACTION of its memory (`device_total`: under
    $CUDABUILD_DEVICE_MEMORY, of that size); None where it cannot say."""
    total = device_total(device, environ)
    return None if total is None else int(total * DEVICE_USABLE_FRACTION)


def memory_ledger(locks: Path) -> Path:
    """The ledger (cudabuild.engine.ledger) of this machine's memory budget."""
    return locks / "ledger-memory.json"


def device_ledger(locks: Path, device: str) -> Path:
    """The ledger of a device's memory budget."""
    return locks / f"ledger-device-{device}.json"


def timing_lock(locks: Path, device: str) -> Path:
    """Held alone around each timing of kernels on `device`, by every stage of every build that
    shares this cache's locks."""
    return locks / f"device-{device}.timing"

"""How much memory a stage held at its peak: resident set size sampled while it runs (Linux).

A thread reads /proc/self/statm every 50 ms while the stage's code runs, and keeps the largest
resident size seen (anonymous memory plus mapped file pages the process touched), and the largest
private part of it (less the file-backed and shared pages: what two stages that map the same
weights do not share). Sampling may
miss a spike shorter than the interval; the process's own high-water mark (VmHWM) does not, but
it covers the whole process, so it cannot say which stage it was. Resetting it per stage
(/proc/self/clear_refs) would do that, at the cost of falsifying what `time -v` and wait4 report
for the build, so it is left alone. Where /proc is missing, peaks are None.

Also here: when a full garbage collection is worth its cost (`collect_if_worth`), after a stage, or
inside one that lets go of a big model.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Optional

INTERVAL_S = 0.05
# Stage code leaves object graphs with reference cycles behind (fx graphs, ExecuTorch programs),
# and with them mapped weights or buffers of gigabytes; a full collection frees them, at 0.1-0.3 s
# with torch loaded, so only after this many bytes grew or were let go.
COLLECT_AFTER_GROWTH = 256 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> Optional[int]:
    return (_statm() or (None, None))[0]


def _statm() -> Optional[tuple[int, int]]:
    """(resident bytes, of which private: not file-backed nor shared memory), or None."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        resident, shared = int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
        return resident, resident - shared
    except (OSError, ValueError, IndexError):
        return None


def collect_if_worth(nbytes: Optional[int]) -> None:
    """A full garbage collection after `nbytes` grew or were let go, when that is worth one; None
    (nobody could measure) always is."""
    if nbytes is None or nbytes > COLLECT_AFTER_GROWTH:
        gc.collect()


class PeakSampler:
    """`with PeakSampler() as s: ...` then `s.peak`: the largest resident size seen, in bytes."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.start: Optional[int] = None  # the resident size on entry
        self.peak: Optional[int] = None
        # The largest private part seen: resident less what is file-backed (mapped weights, which
        # the page cache holds once for every process that maps them) or shared.
        self.peak_private: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        now = _statm()
        if now is not None:
            self.peak = max(self.peak or 0, now[0])
            self.peak_private = max(self.peak_private or 0, now[1])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def grown(self) -> Optional[int]:
        """How far the peak so far is above the resident size on entry, in bytes."""
        return None if self.start is None or self.peak is None else self.peak - self.start

    def __enter__(self) -> "PeakSampler":
        self.start = resident_bytes()
        self._sample()
        if self.peak is not None:
            self._thread = threading.Thread(target=self._loop, name="cudabuild-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def written_bytes() -> Optional[int]:
    """The bytes this process has written to storage so far (/proc/self/io's write_bytes, less
    what it deleted before the kernel wrote it out), or None where /proc cannot say."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["write_bytes"]) - int(fields.get("cancelled_write_bytes", 0))
    except (OSError, ValueError, KeyError):
        return None


class WrittenBytes:
    """`with WrittenBytes() as w: ...` then `w.bytes`: what the block wrote to storage (its
    process's threads; not the compilers it started), or None where /proc cannot say."""

    def __enter__(self) -> "WrittenBytes":
        self._start, self.bytes = written_bytes(), None
        return self

    def __exit__(self, *exc) -> None:
        end = written_bytes()
        if self._start is not None and end is not None:
            self.bytes = max(0, end - self._start)

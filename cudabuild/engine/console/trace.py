"""The build timeline: `build/<model>/<target>/trace.json`, in the Chrome trace event format.

That is the format Bazel's `--profile` writes; Perfetto (ui.perfetto.dev) and chrome://tracing
open it. A build has one span from the process's start to its manifest, a `startup` span (imports,
configuration, planning), one span per stage (its up-to-date check and, if it ran, its run) with
the stage's status and key, nested spans for the phases that cost time (load, autotune, C++
compile, store writes, uploads), a span of category `wait` for each thing a stage waits for (its
memory admission, the device's lock, the key's lock, a lease, a warm process; see
cudabuild.engine.runner's WAITS) and a `manifest` span.

Spans are recorded where they happen, which under `doit -n N` is several processes: each appends
complete events to `build/<model>/<target>/.trace/<pid>.jsonl`, and the manifest task merges this
run's events into trace.json. A lost or damaged part file loses its spans, never the build. A stage
run on a cluster's worker (cudabuild.engine.cluster) is recorded there, handed back with its result
(`take_own`), and added to the driver's part file as one process row per worker (`add_process`).
Engine half; the inductor phases are reported by cudabuild.backend.inductor_phases.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.engine.files import atomic_write_text

STALE_PART_SECONDS = 24 * 3600
_CLOCK_OFFSET = time.time() - time.perf_counter()  # perf_counter, placed on the wall clock
_current: contextvars.ContextVar[Optional["Recorder"]] = contextvars.ContextVar("cudabuild_trace", default=None)


def now_us() -> float:
    return (time.perf_counter() + _CLOCK_OFFSET) * 1e6


def _started_us() -> float:
    """When this process started (Linux: its age since boot from /proc, to 10 ms; the boot time
    itself is only whole seconds), else now."""
    try:
        started_after_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        up = float(Path("/proc/uptime").read_text().split()[0])
        return now_us() - (up - started_after_boot) * 1e6
    except (OSError, ValueError, IndexError):
        return now_us()


# Read when this module is imported, which is in the build's own process (doit loads dodo.py), so
# the doit workers forked from it (`doit -n N`) keep the build's start, not their own.
_STARTED_US = _started_us()


def process_start_us() -> float:
    """When the build's process started: the process that imported this module first."""
    return _STARTED_US


class Recorder:
    """Spans of one build (one build dir, one run id), appended to this process's part file."""

    def __init__(self, build_dir: Path, run_id: str):
        self.dir = build_dir / ".trace"
        self.run_id = run_id
        self._lock = threading.Lock()

    def _emit(self, event: dict) -> None:
        event = dict(event, pid=os.getpid(), tid=threading.get_native_id() % 100000)
        event.setdefault("args", {})["run"] = self.run_id
        line = json.dumps(event, sort_keys=True) + "\n"
        with self._lock, contextlib.suppress(OSError):  # the timeline must never fail a build
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / f"{os.getpid()}.jsonl", "a") as part:
                part.write(line)

    def complete(self, name: str, start_us: float, end_us: float, category: str = "phase", **args) -> None:
        self._emit({"name": name, "cat": category, "ph": "X", "ts": round(start_us, 1),
                    "dur": round(max(end_us - start_us, 0.0), 1), "args": args})

    @contextlib.contextmanager
    def span(self, name: str, category: str = "phase", min_seconds: float = 0.0, **args) -> Iterator[dict]:
        """Time the block; `yield`s a dict whose entries join the span's args (a status, say). Not
        recorded when it took less than `min_seconds`."""
        token = _current.set(self)
        start, extra = now_us(), {}
        try:
            yield extra
        finally:
            _current.reset(token)
            end = now_us()
            if end - start >= min_seconds * 1e6:
                self.complete(name, start, end, category, **{**args, **extra})

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Phases in the block are this recorder's, with no span of its own around them (a warm
        child's stage, whose span its caller records)."""
        token = _current.set(self)
        try:
            yield
        finally:
            _current.reset(token)

    def take_own(self) -> list[dict]:
        """This process's events of this run, removed from its part file: what a cluster worker
        hands back to the driver with a stage it ran (it runs one stage at a time)."""
        part = self.dir / f"{os.getpid()}.jsonl"
        with self._lock:
            try:
                lines = part.read_text().splitlines()
                part.unlink()
            except OSError:
                return []
        taken = []
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("args", {}).get("run") == self.run_id:
                    taken.append(event)
        return taken

    def adopt(self, events: list[dict]) -> None:
        """Another process's events of this run (a warm child's, which ran a stage for this one),
        as this process's own: one row per worker, however its stages ran."""
        for event in events:
            self._emit({k: v for k, v in event.items() if k not in ("pid", "tid")})

    def add_process(self, events: list[dict], name: str, host: str, pid: int) -> None:
        """Events recorded by another process, on another machine perhaps (a cluster worker's), as
        that process's own row, named `name`. The row's pid is derived from (host, pid), so one
        worker keeps one row however many stages it runs, and two hosts' pids cannot collide."""
        row = 1_000_000 + zlib.crc32(f"{host}:{pid}".encode()) % 9_000_000
        lines = [json.dumps({"name": "process_name", "ph": "M", "cat": "process", "pid": row, "tid": 0,
                             "args": {"name": name, "run": self.run_id}}, sort_keys=True)]
        for event in events:
            lines.append(json.dumps(dict(event, pid=row, args=dict(event.get("args", {}), run=self.run_id)), sort_keys=True))
        with self._lock, contextlib.suppress(OSError):  # the timeline must never fail a build
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / f"{os.getpid()}.jsonl", "a") as part:
                part.write("".join(line + "\n" for line in lines))

    def merge(self, build_start_us: float, build_end_us: float, **args) -> Path:
        """Write trace.json from this run's events (every part file), with the whole build's span."""
        events = []
        for part in sorted(self.dir.glob("*.jsonl")) if self.dir.is_dir() else []:
            try:
                lines = part.read_text().splitlines()
            except OSError:
                continue
            kept = []
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                (events if event.get("args", {}).get("run") == self.run_id else kept).append(event)
            # Merged now, or a day old (left by a build that was killed before its manifest). A
            # concurrent build of this project may have merged it already: then it is just gone.
            with contextlib.suppress(OSError):
                if not kept or time.time() - part.stat().st_mtime > STALE_PART_SECONDS:
                    part.unlink()
        events.append({"name": "build", "cat": "build", "ph": "X", "ts": round(build_start_us, 1),
                       "dur": round(build_end_us - build_start_us, 1), "pid": os.getpid(), "tid": 0,
                       "args": dict(args, run=self.run_id)})
        rows = {}  # a worker's row is named once, however many of its stages were added
        for event in events:
            if event.get("ph") == "M":
                rows.setdefault((event["pid"], event["name"]), event)
        events = list(rows.values()) + [e for e in events if e.get("ph") != "M"]
        events.sort(key=lambda e: (e.get("ts", 0.0), -e.get("dur", 0.0)))
        path = self.dir.parent / "trace.json"
        atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=0))
        return path


def recording() -> Optional[Recorder]:
    """The recorder of the stage being recorded in this context, or None: for spans that another
    thread reports (inductor's compile events), which the context does not reach."""
    return _current.get()


@contextlib.contextmanager
def phase(name: str, min_seconds: float = 0.0, **args) -> Iterator[dict]:
    """A span inside whatever stage is being recorded in this context (a no-op outside one); not
    recorded when it took less than `min_seconds` (inductor selects most GEMMs without tuning)."""
    with _span(name, "phase", min_seconds, args) as extra:
        yield extra


@contextlib.contextmanager
def wait(name: str, min_seconds: float = 0.0, **args) -> Iterator[dict]:
    """A wait inside the stage being recorded (a lock, a lease, a process to take a call): a span of
    category "wait", so a trace says where a stage stood still, and for what."""
    with _span(name, "wait", min_seconds, args) as extra:
        yield extra


@contextlib.contextmanager
def _span(name: str, category: str, min_seconds: float, args: dict) -> Iterator[dict]:
    recorder = _current.get()
    if recorder is None:
        yield {}
        return
    with recorder.span(name, category, min_seconds=min_seconds, **args) as extra:
        yield extra

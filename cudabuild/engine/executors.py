"""How a stage that must run is run, behind one interface: here, in a warm process, or on a
cluster's worker.

The runner decides (cudabuild.engine.runner: cached -> restorable -> run) and hands a stage that
must run to its build's executor as a `Job`: what to run and with what, as data, nothing of the
runner (Bazel's Spawn): the stage's I/O (cudabuild.engine.stage_io.StageIO) and what its admission
reads (cudabuild.engine.admission.BuildView). `with executor.run(job) as outcome:` runs it and
gives its `Outcome`:
- `Made`: a StageResult made in this process, its files in a work directory until the block ends;
- `Published`: record K was published elsewhere (by another builder of the key while this one
  waited, by the cache's warm process, or by a cluster's worker).
The runner stores or restores that outcome and writes the stamp inside the block, so the
executor's claim on the key (its lock, its lease) covers the run and the store. The three ways:
- `InProcess` runs it in this process: under the key's lock (two builds of one cache never build
  one key at once), and with a shared tier under the key's lease there (nor two machines: a
  builder that finds another's lease waits for its record, and says it was published), admitted
  beside the build's other stages by memory and device (the job's `admitted`), in a fresh work
  directory with its third-party output in its log.
- `WarmProcess` hands it to the cache's warm process (cudabuild.warm_stage: a fork or a spare that
  imported torch already), which runs it `InProcess` there and stores it in this cache
  (cudabuild.engine.far_end); when none answers, or none can serve, it runs here instead.
- `ClusterWorker` hands it off to a Dask cluster's worker (cudabuild.engine.cluster), which runs it
  the same way and publishes it to the shared tier, and says where it ran and for how long.
Either far end builds the Job from what it is sent, never a runner; a bad upstream blob there
comes back as LostInput (cudabuild.engine.stage_io), for the runner to rewind.

Owns those three ways and what goes with them: the key lock, the lease, the work directory.
Must not touch: the decision, restoring, storing, stamps (runner.py); it is handed no runner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import itertools
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional, Protocol, Union

from cudabuild.engine import admission, memory, room
from cudabuild.engine.admission import WAITS
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.context import StageContext, StageResult
from cudabuild.engine.graph import Stage
from cudabuild.engine.stage_io import LostInput, StageIO
from cudabuild.errors import CudabuildError


@dataclasses.dataclass(frozen=True)
class Job:
    """One stage the runner decided must run, with everything an executor needs to run it here or
    hand it to a process elsewhere."""

    stage: Stage
    key: str
    inputs: dict
    io: StageIO  # its upstream outputs, what it keeps, and what is done about a bad blob
    build: admission.BuildView  # its build, with the build's stamps and store
    module: str  # the stage function's module (its pipeline row's)
    log: Optional[Path]  # where its third-party output goes; None: the console
    note: Callable[[str], None] = terminal.note  # the build's own lines (a wait for another builder)
    # Run inside another stage's run (a producer rewound for its consumer): admitted under its
    # consumer's admission, since asking again could wait on itself.
    nested: bool = False
    # For a process elsewhere: the stage's name in messages (model/target:stage), the driver's
    # toolchain fingerprint and run id.
    label: str = ""
    fingerprint: dict = dataclasses.field(default_factory=dict)
    run_id: str = ""
    # Whether a record another builder published meanwhile is taken (False: build it regardless,
    # because the one found could not be restored).
    look: bool = True

    def context(self, workdir: Path) -> StageContext:
        """The stage's context, in a work directory."""
        return StageContext(self.build.config, self.stage, self.inputs, self.key, workdir, self.io, self.note,
                            self.build.workers)

    def admitted(self) -> ContextManager:
        """Its turn beside the build's other stages (cudabuild.engine.admission)."""
        return contextlib.nullcontext() if self.nested else admission.admitted(self.build, self.stage, self.inputs)

    def resources(self) -> dict:
        """What it asks of a cluster's worker."""
        return admission.resources(self.build, self.stage, self.inputs)


@dataclasses.dataclass(frozen=True)
class Made:
    """The stage ran in this process: its result, its files still in the work directory."""

    result: StageResult
    started: float  # time.monotonic() when it started
    peak_rss: Optional[int]
    written_bytes: Optional[int] = None  # what its process wrote to storage
    peak_private: Optional[int] = None  # the private part of its resident peak


@dataclasses.dataclass(frozen=True)
class Published:
    """Record `key` was published elsewhere; `by` says by whom, in words.

    `status` is what the publisher did for this build: "ran", or another status of its own ("remote":
    a worker found it built); "" when another builder published it while this one waited (the
    restore then says restored or remote). A run's measures go in the stamp.
    """

    key: str
    by: str
    status: str = ""
    seconds: float = 0.0
    peak_rss: Optional[int] = None
    written_bytes: Optional[int] = None
    peak_private: Optional[int] = None
    worker: Optional[dict] = None  # a cluster worker's placement, for the stamp
    span: dict = dataclasses.field(default_factory=dict)  # what joins the stage's span (the warm server's pid)


Outcome = Union[Made, Published]


class Executor(Protocol):
    # Whether a stage it runs writes its log in this build/ (so a failure can show its last lines).
    logs_here: bool

    def run(self, job: Job) -> ContextManager[Outcome]:
        """Run the job; its outcome for the block, the executor's claim on the key held until it ends."""


def log_path(build_dir: Path, stage: Stage) -> Path:
    """Where a stage's third-party output goes when it is captured: build/<model>/<target>/logs/."""
    return build_dir / "logs" / f"{stage.id}.log"


@contextlib.contextmanager
def key_lock(root: Path, key: str):
    """The key's flock in the cache at `root`: one builder of a key at a time on this machine."""
    lock_dir = root / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / key[:16], "a+") as handle:
        with trace.wait(WAITS["key"], key=key[:12]):
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def run_here(job: Job) -> Iterator[Made]:
    """The stage function in this process, in a fresh work directory, once admitted; the work
    directory stays for the block, while the caller stores what it made."""
    with job.io.objects.work_folder(job.stage.id) as work:
        ctx = job.context(work)
        with terminal.capture(job.log) if job.log is not None else contextlib.nullcontext():
            # The stage's module, and what it imports at its top, loads before the stage waits
            # for its turn (a worker's wait is spent importing), and prints into its log.
            with trace.phase("import", min_seconds=0.05):
                module = importlib.import_module(job.module)
            with job.admitted():
                start = time.monotonic()
                with trace.phase("run"), memory.PeakSampler() as sampled, memory.WrittenBytes() as written:
                    # A full disk says so the same way in every stage (inductor's own error wraps
                    # it), and is said before the admission's bookkeeping, on the same disk, fails too.
                    with room.named(job.stage.id, job.io.objects.root):
                        result: StageResult = module.run(ctx)
                # What the stage left behind is collected now, before the next stage (here, or
                # let in beside) adds its own: after a stage that held much more than it started
                # with (where /proc cannot say, always).
                memory.collect_if_worth(sampled.grown())
        yield Made(result, start, sampled.peak, written.bytes, sampled.peak_private)


class InProcess:
    """Here: the key's lock, then the key's lease on the shared tier, then the stage."""

    logs_here = True

    @contextlib.contextmanager
    def run(self, job: Job) -> Iterator[Outcome]:
        with key_lock(job.io.objects.root, job.key):
            # Another process may have built this key while we waited for the lock, and another
            # machine may be building it now.
            lease = self.claim(job)
            if lease is None:
                yield Published(job.key, "another builder")
                return
            with lease, run_here(job) as made:
                yield made

    @staticmethod
    def claim(job: Job):
        """None when the key's record is there now, else a lease to build under.

        Without a shared tier the lease is a no-op. With one, it is the key's build lease there
        (build-once across machines): while another builder holds it, wait until its record
        appears or the lease goes (released, or lapsed because the holder died), then take the
        record or the lease. After $CUDABUILD_REMOTE_WAIT_SECONDS of waiting, build anyway.
        """
        actions, key = job.io.actions, job.key
        remote = actions.remote
        deadline = time.monotonic() + (remote.wait_seconds if remote is not None else 0.0)
        for polls in itertools.count():
            lease = remote.try_lease(key) if remote is not None else None
            # Look after claiming: the holder may have published and let go since our last look.
            # Only look: taking the record (and saying which tier it came from) is the runner's.
            if job.look and actions.lookup(key)[0] is not None:
                if lease is not None:
                    lease.release()
                return None
            if lease is not None or remote is None or not job.look:
                return lease or contextlib.nullcontext()
            if time.monotonic() >= deadline:
                job.note(f"{job.stage.id}: gave up waiting for another builder of {key[:12]}; building it here")
                return contextlib.nullcontext()
            if not polls:
                job.note(f"{job.stage.id}: another builder is building {key[:12]}; waiting for its result")
            with trace.wait(WAITS["lease"], key=key[:12]):
                remote.wait_for_result(key, deadline)


@dataclasses.dataclass
class WarmProcess:
    """In the cache's warm process. `call(job)` asks it (cudabuild.warm_stage.WarmStages) and
    gives back its outcome; `here` runs what it cannot serve."""

    call: Optional[Callable[[Job], dict]]
    here: InProcess = dataclasses.field(default_factory=InProcess)
    logs_here = True

    @contextlib.contextmanager
    def run(self, job: Job) -> Iterator[Outcome]:
        """Its server's pid goes in the stage's span. Here instead when none answers and this build
        starts none (later stages ask again), or none could serve (later stages run here too)."""
        from cudabuild.engine.warm import WarmNotRunning, WarmUnavailable

        outcome = None
        if self.call is not None:
            asked = trace.now_us()
            try:
                outcome = self.call(job)
            except WarmNotRunning:  # none up, and this build does not start one: run here, no warning
                pass
            except WarmUnavailable as e:
                # The time spent waiting for one that did not come is named (a served call's own
                # wait is recorded by the process that took it, from when it was asked: warm_stage).
                if (recorder := trace.recording()) is not None:
                    recorder.complete(WAITS["warm"], asked, trace.now_us(), "wait", served=False)
                terminal.warn(f"{e}; stages run in the build's own processes")
                self.call = None
        if outcome is None:
            with self.here.run(job) as here:
                yield here
            return
        if (recorder := trace.recording()) is not None:
            recorder.adopt(outcome.get("events") or [])
        if outcome.get("error") is not None:
            raise outcome["error"]  # a LostInput among them: the runner rewinds
        yield Published(job.key, f"the warm process ({outcome.get('server')})", status=outcome["status"],
                        seconds=outcome.get("seconds") or 0.0, peak_rss=outcome.get("peak_rss"),
                        written_bytes=outcome.get("written_bytes"), peak_private=outcome.get("peak_private"),
                        span={"warm": outcome.get("server")})


@dataclasses.dataclass
class ClusterWorker:
    """On a Dask cluster's worker. `hand_off(label, work, resources)` sends it there and gives back
    the outcome its worker reports once the record is in the shared tier (cudabuild.engine.cluster
    Pool.hand_off)."""

    hand_off: Callable[[str, dict, dict], dict]
    logs_here = False  # the worker's log is its own; a failure's last lines come back in its error

    @contextlib.contextmanager
    def run(self, job: Job) -> Iterator[Outcome]:
        """What the worker published: `ran` when it built the stage, `remote` when it found it
        built already; where it ran, and for how long. LostInput where an upstream blob was bad there."""
        work = {"stage": [job.stage.kind, job.stage.method], "key": job.key, "inputs": job.inputs,
                "upstream": job.io.upstream_stamps(), "fingerprint": job.fingerprint, "run": job.run_id}
        outcome = self.hand_off(job.label, work, job.resources())
        worker = outcome.get("worker") or {}
        on = f"{worker.get('host')}:{worker.get('pid')}"
        if outcome.get("events") and (recorder := trace.recording()) is not None:
            gpu = f", GPU {worker['gpu']}" if worker.get("gpu") not in (None, "") else ""
            recorder.add_process(outcome["events"], f"worker {worker.get('name')} ({on}{gpu})",
                                 str(worker.get("host")), int(worker.get("pid") or 0))
        if outcome.get("status") == "failed":
            raise CudabuildError(f"on worker {worker.get('name')} ({on}): {outcome['error']}")
        if outcome.get("status") == "lost":
            raise LostInput(*outcome["producer"], outcome["error"])
        ran = outcome.get("status") == "ran"
        yield Published(job.key, f"on worker {worker.get('name')} ({on})", status="ran" if ran else "remote",
                        seconds=float(outcome.get("seconds") or 0.0) if ran else 0.0,
                        peak_rss=outcome.get("peak_rss") if ran else None, worker=worker or None)

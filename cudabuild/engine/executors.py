"""How a stage that must run is run, behind one interface: here, in a warm process, or on a
cluster's worker.

The runner decides (cudabuild.engine.runner: cached -> restorable -> run) and hands a stage that
must run to its build's executor: `executor.run(runner, stage, decision, span) -> status`.
- `InProcess` runs it in this process: under the key's lock (two builds of one cache never build
  one key at once), and with a shared tier under the key's lease there (nor two machines: a
  builder that finds another's lease waits for its record, then restores it), admitted beside the
  build's other stages by memory and device (cudabuild.engine.admission), in a fresh work
  directory with its third-party output in its log; the runner then stores what it made.
- `WarmProcess` hands it to the cache's warm process (cudabuild.warm_stage: a fork or a spare that
  imported torch already), which runs it `InProcess` there; when none answers, or none can
  serve, it runs here instead.
- `ClusterWorker` hands it off to a Dask cluster's worker (cudabuild.engine.cluster), which
  publishes it to the shared tier; it is restored from there like any record, its stamp saying it
  ran, where, and how long it took.

Owns those three ways and what goes with them: the key lock, the lease, the admission, the work
directory. Must not touch: the decision, restoring, or the store's records (runner.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import itertools
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Protocol

from cudabuild.engine import admission, memory, room
from cudabuild.engine.admission import WAITS
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.context import StageContext, StageResult
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.engine.graph import Stage
from cudabuild.errors import CacheUnwritable, CudabuildError


class Executor(Protocol):
    def run(self, runner, stage: Stage, decision, span: dict) -> str:
        """Bring a stage the runner decided must run up to date; its status (ran, restored, remote)."""


@contextlib.contextmanager
def key_lock(store, key: str):
    """The key's flock in the cache: one builder of a key at a time on this machine."""
    lock_dir = store.root / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / key[:16], "a+") as handle:
        with trace.wait(WAITS["key"], key=key[:12]):
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_here(runner, stage: Stage, key: str, inputs: dict, why: Optional[str]) -> None:
    """The stage function in this process, in a fresh work directory, once admitted; then the
    runner stores its outputs, record and stamp. The caller holds the key's lock."""
    # Beside the cache, on its filesystem: what the stage writes is moved into the cache, not copied.
    work = runner.store.root / "work"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{stage.id}-", dir=work) as tmp:
        ctx = StageContext(runner.config, stage, inputs, key, Path(tmp), runner, runner.log)
        with runner.output_of(stage):
            # The stage's module, and what it imports at its top, loads before the stage waits
            # for its turn (a worker's wait is spent importing), and prints into its log.
            with trace.phase("import", min_seconds=0.05):
                module = importlib.import_module(runner.pipeline.row(stage).module)
            with admission.admitted(runner, stage, inputs):
                start = time.monotonic()
                with trace.phase("run"), memory.PeakSampler() as sampled, memory.WrittenBytes() as written:
                    try:
                        result: StageResult = module.run(ctx)
                    except Exception as e:
                        # A full disk says so the same way in every stage (inductor's own error wraps it).
                        full = room.disk_full(e)
                        if full is not None and not isinstance(e, (room.DiskFull, CacheUnwritable)):
                            raise room.full_disk_error(stage.id, full, runner.store.root) from e
                        raise
                # What the stage left behind is collected now, before the next stage (here, or
                # let in beside) adds its own: after a stage that held much more than it started
                # with (where /proc cannot say, always).
                memory.collect_if_worth(sampled.grown())
        runner.store_result(stage, key, inputs, result, started=start, why=why, peak_rss=sampled.peak,
                            written_bytes=written.bytes, peak_private=sampled.peak_private)


class InProcess:
    """Here: the key's lock, then the key's lease on the shared tier, then the stage."""

    def run(self, runner, stage: Stage, decision, span: dict) -> str:
        key, inputs, old = decision.key, decision.inputs, decision.old
        with key_lock(runner.store, key):
            # Another process may have built this key while we waited for the lock, and another
            # machine may be building it now.
            status, lease = self.claim(runner, stage, key, inputs)
            if status:
                return status
            why = explain_reason(old.inputs if old else None, inputs, runner.pipeline)
            with lease:
                run_here(runner, stage, key, inputs, why)
        return "ran"

    @staticmethod
    def claim(runner, stage: Stage, key: str, inputs: dict):
        """(status, None) when the key can be restored now, else (None, a lease to build under).

        Without a shared tier the lease is a no-op. With one, it is the key's build lease there
        (build-once across machines): while another builder holds it, wait until its record
        appears or the lease goes (released, or lapsed because the holder died), then restore or
        take the lease over. After $CUDABUILD_REMOTE_WAIT_SECONDS of waiting, build anyway.
        """
        remote = runner.store.remote
        deadline = time.monotonic() + (remote.wait_seconds if remote is not None else 0.0)
        for polls in itertools.count():
            lease = remote.try_lease(key) if remote is not None else None
            # Restore after claiming: the holder may have published and let go since our last look.
            record, tier = runner.store.find_record(key)
            if record is not None and (status := runner.restore(stage, key, inputs, record, tier)):
                if lease is not None:
                    lease.release()
                return status, None
            if lease is not None or remote is None:
                return None, lease or contextlib.nullcontext()
            if time.monotonic() >= deadline:
                runner.log(f"{stage.id}: gave up waiting for another builder of {key[:12]}; building it here")
                return None, contextlib.nullcontext()
            if not polls:
                runner.log(f"{stage.id}: another builder is building {key[:12]}; waiting for its result")
            with trace.wait(WAITS["lease"], key=key[:12]):
                remote.wait_for_result(key, deadline)


@dataclasses.dataclass
class WarmProcess:
    """In the cache's warm process. `call(stage)` asks it (cudabuild.warm_stage.WarmStages) and
    gives back its outcome; `here` runs what it cannot serve."""

    call: Optional[Callable[[Stage], dict]]
    here: Executor = dataclasses.field(default_factory=InProcess)

    def run(self, runner, stage: Stage, decision, span: dict) -> str:
        """Its server's pid goes in the stage's span. Here instead when none answers and this build
        starts none (later stages ask again), or none could serve (later stages run here too)."""
        from cudabuild.engine.warm import WarmNotRunning, WarmUnavailable

        if self.call is None:
            return self.here.run(runner, stage, decision, span)
        asked = trace.now_us()
        try:
            outcome = self.call(stage)
        except WarmNotRunning:  # none up, and this build does not start one: run here, no warning
            return self.here.run(runner, stage, decision, span)
        except WarmUnavailable as e:
            # The time spent waiting for one that did not come is named (a served call's own wait
            # is recorded by the process that took it, from when it was asked: warm_stage).
            runner.recorder.complete(WAITS["warm"], asked, trace.now_us(), "wait", served=False)
            terminal.warn(f"{e}; stages run in the build's own processes")
            self.call = None
            return self.here.run(runner, stage, decision, span)
        runner.logs[stage.id] = runner.log_path(stage)
        span["warm"] = outcome.get("server")
        runner.recorder.adopt(outcome.get("events") or [])
        if outcome.get("error") is not None:
            raise outcome["error"]
        return outcome["status"]


@dataclasses.dataclass
class ClusterWorker:
    """On a Dask cluster's worker. `hand_off(label, work, resources)` sends it there and gives back
    the outcome its worker reports once the record is in the shared tier (cudabuild.engine.cluster
    Pool.hand_off)."""

    hand_off: Callable[[str, dict, dict], dict]

    def run(self, runner, stage: Stage, decision, span: dict) -> str:
        """Restore what the worker published: `ran` when it built the stage, `remote` when it found
        it built already. The stamp says where it ran, for how long, and why."""
        key, inputs = decision.key, decision.inputs
        upstream = {d.id: dataclasses.asdict(runner.require_stamp(d)) for d in runner.pipeline.dependencies(stage, runner.config)}
        work = {"stage": [stage.kind, stage.method], "key": key, "inputs": inputs, "upstream": upstream,
                "fingerprint": runner.fingerprint(), "run": runner.run_id}
        label = f"{runner.config.model}/{runner.config.target}:{stage.id}"
        outcome = self.hand_off(label, work, admission.resources(runner, stage, inputs))
        worker = outcome.get("worker") or {}
        on = f"{worker.get('host')}:{worker.get('pid')}"
        if outcome.get("events"):
            gpu = f", GPU {worker['gpu']}" if worker.get("gpu") not in (None, "") else ""
            runner.recorder.add_process(outcome["events"], f"worker {worker.get('name')} ({on}{gpu})",
                                        str(worker.get("host")), int(worker.get("pid") or 0))
        if outcome.get("status") == "failed":
            raise CudabuildError(f"on worker {worker.get('name')} ({on}): {outcome['error']}")
        record, tier = runner.store.find_record(key)
        where = runner.store.remote.where if runner.store.remote is not None else "none"
        if record is None or not runner.restore(stage, key, inputs, record, tier):
            raise CudabuildError(f"stage {stage.id} {outcome.get('status')} on worker {worker.get('name')} ({on}), "
                                 f"but its record {key[:12]} is not in the shared tier {where}: start the workers "
                                 "with the driver's CUDABUILD_REMOTE")
        status = "ran" if outcome.get("status") == "ran" else "remote"
        restored = runner.require_stamp(stage)
        runner.write_stamp(stage, restored.replace(
            status=status, seconds=float(outcome.get("seconds") or 0.0) if status == "ran" else 0.0,
            reason=outcome.get("reason") if status == "ran" else None,
            peak_rss=outcome.get("peak_rss") if status == "ran" else None,
            saved_seconds=None if status == "ran" else restored.saved_seconds, worker=worker or None))
        return status

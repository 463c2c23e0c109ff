"""Deciding one stage against the cache, and settling it: cached, restored, or run by the build's
executor and stored.

For a stage with action key K (the digest of its inputs, see graph.py), `decide` climbs one ladder,
the same for a build, doit's up-to-date check and `cudabuild explain`:
1. `cached`: its stamp in build/<model>/<target>/.stamps/ holds K, and its final outputs in build/
   still have the recorded hashes (checked by stat through the hash memo). Nothing is done.
2. `restorable`: the action cache has a record for K whose blobs are all present: the record's
   final outputs are put back in build/ (ActionCache.restore: each blob checked against its hash,
   once per change of its file; reflinked where the filesystem can, else copied by the kernel:
   never linked, so editing build/ cannot touch the cache) and the stamp is written from the
   record. Its status is `restored`, or `remote` when the record or a final output came from the
   shared tier ($CUDABUILD_REMOTE, see cudabuild.engine.tiers). Intermediate artifacts stay in the
   store until a stage that runs needs them; big ones are then mapped from it, not read.
3. `run`: the build's executor runs it (cudabuild.engine.executors: here, in a warm process, or on
   a cluster's worker, with the key's lock, the lease and the admission that go with each), handed
   a Job that carries the stage's I/O as data (cudabuild.engine.stage_io), and gives its outcome,
   which is settled here while the executor's claim on the key holds: a result made here is stored
   (ActionCache.store: its outputs into the store, then the record), stamped, and written back to
   the shared tier; a record published elsewhere is restored, its stamp saying who ran it, where
   and for how long.

An upstream output that was needed but turns out corrupt or missing makes its producer run again
through the same executor (`rewind`, what Bazel calls rewinding), never served: the stage's I/O
calls `rewind` while the stage runs here; a stage run in another process (a warm process, a
cluster's worker: cudabuild.engine.far_end) gives LostInput back instead, and its producer is
rewound, then the stage decided and run again (once per producer).

Owns the decision, settling an outcome (what to restore or store, and the stamp), and rewinding.
Must not touch: how a stage runs (executors.py), what it reads (stage_io.py), what the cache keeps
(object_store.py, action_cache.py), the manifest (manifest.py), the cache's size (cache_admin.py,
once a build ends).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cudabuild.engine import admission, executors, room
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.context import StageResult
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.errors import CudabuildError
from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.graph import Build, Pipeline, ResultReader, Stage, pending_in
from cudabuild.engine.hashing import digest
from cudabuild.engine.stage_io import LostInput, StageIO
from cudabuild.engine.stamp import Stamp, Stamps
from cudabuild.engine.store import Store


@dataclass(frozen=True)
class Decision:
    """Where a stage stands, decided once (Runner.decide) for every caller.

    verdict: `cached` (the stamp holds the key and build/'s files are intact), `restorable` (a
    record for the key was found: `record`, in `tier` local or remote), `run`, or `wait` (the key
    depends on upstream results not known yet: `waits`, only when the reader predicts them).
    """

    stage: Stage
    verdict: str
    inputs: dict
    key: Optional[str]
    old: Optional[Stamp]
    record: Optional[dict] = None
    tier: str = ""
    waits: frozenset = frozenset()


@dataclass
class Runner:
    config: Build
    store: Store
    run_id: str
    log: Callable[[str], None] = terminal.note
    statuses: dict = field(default_factory=dict)  # stage id -> status for this process
    # Third-party output of a stage that runs goes to its log (cudabuild.engine.console.terminal), unless streamed.
    capture_output: bool = True
    logs: dict = field(default_factory=dict)  # stage id -> the log this process's run of it wrote
    # How many stages this build runs at once (doit's worker processes): see cudabuild.engine.workers.
    workers: int = 1
    # How a stage that must run is run: here (the default), in the cache's warm process, or on a
    # cluster's worker (cudabuild.engine.executors).
    executor: executors.Executor = field(default_factory=executors.InProcess)
    # The cheap toolchain fingerprint probe is keyed on: this machine's, computed on first use.
    _fingerprint: Optional[dict] = None
    _recorder: Optional[trace.Recorder] = None
    _started_in: int = field(default_factory=os.getpid)
    _startup_recorded: bool = False

    def __post_init__(self):
        self.stamps = Stamps.of(self.config)

    @property
    def pipeline(self) -> Pipeline:
        return self.config.pipeline

    def read_stamp(self, stage: Stage) -> Optional[Stamp]:
        """The stage's stamp in this build's build/ (Stamps.read), or None."""
        return self.stamps.read(stage)

    # -- keys ----------------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = self.pipeline.cheap_fingerprint(self.config.target)
        return self._fingerprint

    def checkpoint_digest(self, folder=None, layout: bool = False) -> Optional[dict]:
        """Pipeline.checkpoint_digest of `folder` (default: the build's checkpoint), through the cache's memo."""
        return self.pipeline.checkpoint_digest(self.config, self.store.hasher, folder, layout)

    def inputs(self, stage: Stage, read: Optional[ResultReader] = None) -> dict:
        return self.pipeline.inputs(stage, self.config, read or self.stamps.result, self.fingerprint,
                                    self.checkpoint_digest)

    # -- up-to-date ----------------------------------------------------------------------------

    def finals_intact(self, stamp: Stamp) -> bool:
        return all(self.store.hasher(self.config.build_dir / name) == stamp.outputs[name] for name in stamp.finals)

    def decide(self, stage: Stage, read: Optional[ResultReader] = None,
               find: Optional[Callable[[str], tuple[Optional[dict], str]]] = None) -> Decision:
        """The up-to-date ladder: cached -> restorable -> run.

        `read` gives upstream results (default: the stamps in build/; explain passes predicted
        ones, which may be Pending: then the verdict is `wait`). `find(key) -> (record, tier)` looks
        the key up in the action cache (a build takes what it finds: ActionCache.lookup with
        take; explain only looks); without it the store is not consulted and a restorable stage reads
        as `run`, which is what doit's up-to-date check wants (the restore happens in execute).
        """
        inputs = self.inputs(stage, read)
        old = self.read_stamp(stage)
        waits = pending_in(inputs)
        if waits:
            return Decision(stage, "wait", inputs, None, old, waits=frozenset(waits))
        key = digest(inputs)
        if old is not None and old.key == key and self.finals_intact(old):
            return Decision(stage, "cached", inputs, key, old)
        if find is not None:
            record, tier = find(key)
            if record is not None:
                return Decision(stage, "restorable", inputs, key, old, record, tier)
        return Decision(stage, "run", inputs, key, old)

    def is_up_to_date(self, stage: Stage) -> bool:
        self.record_startup()
        start = trace.now_us()
        decision = self.decide(stage)
        fresh = decision.verdict == "cached"
        args = {"status": "cached", "key": decision.key} if fresh else {}
        self.recorder.complete(stage.id, start, trace.now_us(), "stage", step="check", **args)
        return fresh

    # -- timeline and logs ---------------------------------------------------------------------

    @property
    def recorder(self) -> trace.Recorder:
        if self._recorder is None:
            self._recorder = trace.Recorder(self.config.build_dir, self.run_id)
        return self._recorder

    def record_startup(self) -> None:
        """The span from the process's start to its first stage: imports, configuration, planning."""
        if not self._startup_recorded and os.getpid() == self._started_in:
            self._startup_recorded = True
            self.recorder.complete("startup", trace.process_start_us(), trace.now_us(), "build")

    def log_path(self, stage: Stage) -> Path:
        return executors.log_path(self.config.build_dir, stage)

    # -- execution -----------------------------------------------------------------------------

    def execute(self, stage: Stage) -> str:
        """Bring one stage up to date; returns ran, cached, restored or remote."""
        self.record_startup()
        # A full disk met anywhere in it (the stage, storing or restoring what it made, its log,
        # in this process or a warm one) is said in the one line every stage says (room.named).
        with room.named(stage.id, self.store.root, self.config.build_dir), \
                self.recorder.span(stage.id, "stage", step="execute") as span:
            span["status"] = status = self._execute(stage, span)
        return status

    def _execute(self, stage: Stage, span: dict) -> str:
        return self._rewinding(lambda: self._climb(stage, span))

    def _climb(self, stage: Stage, span: dict) -> str:
        """The ladder for a stage, and what its verdict asks done."""
        decision = self.decide(stage, find=functools.partial(self.store.actions.lookup, take=True))
        span["key"] = decision.key
        if decision.verdict == "cached":
            return self._note(stage, "cached")
        if decision.verdict == "restorable":
            status = self.restore(stage, decision.key, decision.inputs, decision.record, decision.tier)
            if status:
                self._log_restored(stage, status, decision.key, decision.record)
                return self._note(stage, status)
        why = explain_reason(decision.old.inputs if decision.old else None, decision.inputs, self.pipeline)
        return self._note(stage, self._run(self._job(stage, decision.key, decision.inputs), why, span))

    def _note(self, stage: Stage, status: str) -> str:
        self.statuses[stage.id] = status
        return status

    def io(self, stage: Stage) -> StageIO:
        """The stage's I/O as a stage run by this build's executor gets it: a bad upstream blob rewinds its producer."""
        return StageIO(stage, tuple(self.pipeline.dependencies(stage, self.config)), self.stamps, self.store.objects,
                       self.store.actions, rewind=self.rewind)

    def _job(self, stage: Stage, key: str, inputs: dict, nested: bool = False) -> executors.Job:
        """The stage as the executor gets it. `nested`: run inside another stage's run (a producer
        rewound for its consumer), whose admission it runs under."""
        return executors.Job(
            stage, key, inputs, self.io(stage),
            admission.BuildView(self.config, self.stamps, self.store, self.workers, self.log),
            self.pipeline.row(stage).module, log=self.log_path(stage) if self.capture_output else None,
            note=self.log, nested=nested, label=f"{self.config.model}/{self.config.target}:{stage.id}",
            fingerprint=self.fingerprint(), run_id=self.run_id)

    def _run(self, job: executors.Job, why: Optional[str], span: dict) -> str:
        """The job run by the build's executor, and its outcome settled (stored, or restored, and
        stamped) while the executor's claim on the key holds."""
        if job.log is not None and self.executor.logs_here:
            self.logs[job.stage.id] = job.log
        with self.executor.run(job) as outcome:
            status = self._settle(job, outcome, why, span)
        if status is None:  # another builder's record could not be restored (and was dropped): build it
            return self._run(dataclasses.replace(job, look=False), why, span)
        return status

    # -- settling ------------------------------------------------------------------------------

    def _settle(self, job: executors.Job, outcome: executors.Outcome, why: Optional[str], span: dict) -> Optional[str]:
        """Store what was made here; restore what was published elsewhere (None when that cannot
        be done for a record another builder published, which is then built here)."""
        stage = job.stage
        if isinstance(outcome, executors.Made):
            self.store_result(stage, job.key, job.inputs, outcome.result, started=outcome.started, why=why,
                              peak_rss=outcome.peak_rss, written_bytes=outcome.written_bytes,
                              peak_private=outcome.peak_private, io=job.io)
            return "ran"
        span.update(outcome.span)
        record, tier = self.store.actions.lookup(outcome.key, take=True)
        status = self.restore(stage, job.key, job.inputs, record, tier) if record is not None else None
        if status is None and outcome.status:
            where = self.store.remote.where if self.store.remote is not None else "none"
            raise CudabuildError(f"stage {stage.id} {outcome.status} {outcome.by}, but its record {job.key[:12]} is not in "
                                 f"the shared tier {where}: start the workers with the driver's CUDABUILD_REMOTE")
        if status is None or not outcome.status:
            return status
        # Run (or found built) for this build elsewhere: the stamp says where, for how long and why.
        restored = self.stamps.require(stage)
        ran = outcome.status == "ran"
        self.stamps.write(stage, restored.replace(
            status=outcome.status, seconds=outcome.seconds if ran else 0.0, reason=why if ran else None,
            peak_rss=outcome.peak_rss if ran else None, written_bytes=outcome.written_bytes if ran else None,
            peak_private=outcome.peak_private if ran else None, saved_seconds=None if ran else restored.saved_seconds,
            worker=outcome.worker))
        return outcome.status

    def restore(self, stage: Stage, key: str, inputs: dict, record: dict, source: str) -> Optional[str]:
        """Serve a record found for the key in tier `source` (ActionCache.restore, then the stamp):
        restored (from this cache), remote (the record or a final output came from the shared
        tier), or None when its blobs turn out unusable."""
        fetched = self.store.actions.restore(key, record, self.config.build_dir)
        if fetched is None:
            return None
        status = "remote" if "remote" in (source, fetched) else "restored"
        self.stamps.write(stage, Stamp(
            key=key, inputs=inputs, digest=record["digest"], outputs=record["outputs"], finals=record.get("finals", []),
            value=record.get("value"), status=status, seconds=0.0, saved_seconds=record.get("seconds", 0.0),
            run=self.run_id,
        ))
        return status

    def _log_restored(self, stage: Stage, status: str, key: str, record: dict) -> None:
        """A stage restored here ran nothing, so no library printed anything: its log (what a
        user of build/ looks in, logs/<stage>.log) says so, and where its outputs came from, in
        place of the log of a run that made other outputs."""
        if not self.capture_output:
            return  # a streaming build writes no logs
        where = (f"the shared tier {self.store.remote.where}" if status == "remote" and self.store.remote is not None
                 else f"the cache at {self.store.root}")
        made = f"; it ran for {record['seconds']:.1f}s in the build that made it" if record.get("seconds") else ""
        atomic_write_text(self.log_path(stage), f"{stage.id}: restored from {where} (key {key[:12]}), not run in this "
                                                f"build, so nothing was printed{made}\n")

    def store_result(self, stage: Stage, key: str, inputs: dict, result: StageResult, started: float,
                     why: Optional[str], peak_rss: Optional[int], written_bytes: Optional[int] = None,
                     peak_private: Optional[int] = None, io: Optional[StageIO] = None) -> None:
        """What a stage that ran here made, stored (ActionCache.store: its files into the store, its
        final outputs into build/ too, the record), then the stamp; then written back to the shared
        tier. Called while the stage's work directory still holds its files. `io`: the stage's I/O
        (default: this build's), which checks what it handed on unchanged."""
        record = self.store.actions.store(key, stage.id, result, self.pipeline.final_outputs(stage),
                                          self.config.build_dir, started, (io or self.io(stage)).handed_on)
        self.stamps.write(stage, Stamp(
            key=key, inputs=inputs, digest=record["digest"], outputs=record["outputs"], finals=record["finals"],
            value=result.value,
            status="ran", seconds=record["seconds"], run=self.run_id, reason=why, peak_rss=peak_rss,
            written_bytes=written_bytes, peak_private=peak_private,
        ))
        self.store.actions.write_back(stage.id, key, record)

    # -- rewinding -----------------------------------------------------------------------------

    def rewind(self, stage: Stage) -> None:
        """Bring a producer up to date again, through the build's executor, because an output it
        recorded can no longer be served (StageIO's `rewind`). Its record and stamp go first, so
        whoever runs it decides afresh: it runs, or its record is taken from the shared tier, whose
        copy of the output is fetched and checked again on the next read."""
        stamp = self.read_stamp(stage)
        if stamp:
            self.store.actions.drop_record(stamp.key)
        self.stamps.path(stage).unlink(missing_ok=True)
        self.log(f"{stage.id}: a cached output was missing or corrupt; running it again")

        def again() -> str:
            inputs = self.inputs(stage)
            return self._run(self._job(stage, digest(inputs), inputs, nested=True), "a cached output was missing or corrupt", {})

        self.statuses[stage.id] = self._rewinding(again)

    def _rewinding(self, attempt: Callable[[], str]) -> str:
        """attempt(); where a stage run in another process lost an upstream output (LostInput), its
        producer rewound, then attempt() again: once per producer, the second loss is the error."""
        rewound: set[Stage] = set()
        while True:
            try:
                return attempt()
            except LostInput as lost:
                if lost.producer in rewound:
                    raise
                rewound.add(lost.producer)
                self.rewind(lost.producer)

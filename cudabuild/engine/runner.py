"""Deciding one stage against the cache, and serving or storing it: cached, restored, or run by the
build's executor and stored.

For a stage with action key K (the digest of its inputs, see graph.py), `decide` climbs one ladder,
the same for a build, doit's up-to-date check and `cudabuild explain`:
1. `cached`: its stamp in build/<model>/<target>/.stamps/ holds K, and its final outputs in build/
   still have the recorded hashes (checked by stat through the hash memo). Nothing is done.
2. `restorable`: the store has a record for K whose blobs are all present: `restore` rewrites the
   stamp from the record and puts final outputs back in build/ (each blob checked against its hash,
   once per change of its file; reflinked where the filesystem can, else copied by the kernel:
   never linked, so editing build/ cannot touch the cache). Its status is `restored`, or `remote`
   when the record or a final output came from the shared tier ($CUDABUILD_REMOTE, see
   cudabuild.engine.tiers). Intermediate artifacts stay in the store until a stage that runs needs
   them; big ones are then mapped from it, not read (output_path).
3. `run`: the build's executor runs it (cudabuild.engine.executors: here, in a warm process, or on
   a cluster's worker, with the key's lock, the lease and the admission that go with each) and
   gives its outcome, which is settled here while the executor's claim on the key holds: a result
   made here is stored (`store_result`: its outputs into the store, then the record, then the
   stamp, then written back to the shared tier); a record published elsewhere is restored, its
   stamp saying who ran it, where and for how long. An output that was needed but turns out
   corrupt or missing makes its producer run again, through the same executor (`_rebuild`, what
   Bazel calls rewinding), never served.

Owns the decision, restoring, storing, stamps and serving upstream outputs to a stage. Must not
touch: how a stage runs (executors.py), the manifest (manifest.py), the cache's size
(cache_admin.py, once a build ends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cudabuild.engine import admission, executors, room
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.context import StageContext, StageResult
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.errors import CorruptBlob, CudabuildError, MissingBlob
from cudabuild.engine.files import atomic_write_text, move_or_copy
from cudabuild.engine.graph import Build, Pipeline, Result, ResultReader, Stage, pending_in
from cudabuild.engine.hashing import digest
from cudabuild.engine.stamp import Stamp, stamps_dir
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
    # Whether what a stage stores must reach the shared tier (a cluster's worker: its driver
    # restores it from there), so a write-back that fails fails the stage.
    publish_required: bool = False
    # The cheap toolchain fingerprint probe is keyed on: this machine's, computed on first use, or
    # handed in (a cluster's worker keys on its driver's, cudabuild.cluster_worker).
    _fingerprint: Optional[dict] = None
    _recorder: Optional[trace.Recorder] = None
    _started_in: int = field(default_factory=os.getpid)
    _startup_recorded: bool = False

    @property
    def pipeline(self) -> Pipeline:
        return self.config.pipeline

    # -- stamps ---------------------------------------------------------------------------------

    def stamp_path(self, stage: Stage) -> Path:
        return stamps_dir(self.config.build_dir) / f"{stage.id}.json"

    def read_stamp(self, stage: Stage) -> Optional[Stamp]:
        return Stamp.load(self.stamp_path(stage))

    def read_result(self, stage: Stage) -> Optional[Result]:
        stamp = self.read_stamp(stage)
        return stamp.result if stamp else None

    def require_stamp(self, stage: Stage) -> Stamp:
        stamp = self.read_stamp(stage)
        if stamp is None:
            raise CudabuildError(f"stage {stage.id} has not been built yet for {self.config.model}/{self.config.target}")
        return stamp

    def write_stamp(self, stage: Stage, stamp: Stamp) -> None:
        stamp.save(self.stamp_path(stage))

    # -- keys ----------------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = self.pipeline.cheap_fingerprint(self.config.target)
        return self._fingerprint

    def checkpoint_digest(self, folder=None, layout: bool = False) -> Optional[dict]:
        """The digest of `folder` (default: the build's checkpoint), file by file and, for files
        the pipeline can split, part by part; None without a folder. With `layout`, those parts by
        what they are, not what they hold (Pipeline.layout_digests: a tensor's dtype and shape)."""
        folder = Path(folder).expanduser().resolve() if folder else self.config.checkpoint
        if not folder:
            return None
        if layout:
            return self.store.hasher.tree(folder, parts=self.pipeline.layout_digests, tag="layout")
        return self.store.hasher.tree(folder, parts=self.pipeline.content_digests)

    def inputs(self, stage: Stage, read: Optional[ResultReader] = None) -> dict:
        return self.pipeline.inputs(stage, self.config, read or self.read_result, self.fingerprint,
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
        return self.config.build_dir / "logs" / f"{stage.id}.log"

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

    def _job(self, stage: Stage, key: str, inputs: dict, nested: bool = False) -> executors.Job:
        """The stage as the executor gets it. `nested`: run inside another stage's run (a producer
        rebuilt for its consumer), whose admission it runs under: asking again could wait on itself."""
        upstream = {d.id: dataclasses.asdict(stamp) for d in self.pipeline.dependencies(stage, self.config)
                    if (stamp := self.read_stamp(d)) is not None}
        return executors.Job(
            stage, key, inputs, self.store, self.pipeline.row(stage).module,
            context=lambda workdir: StageContext(self.config, stage, inputs, key, workdir, self, self.log),
            admitted=contextlib.nullcontext if nested else lambda: admission.admitted(self, stage, inputs),
            log=self.log_path(stage) if self.capture_output else None, note=self.log,
            label=f"{self.config.model}/{self.config.target}:{stage.id}", upstream=upstream,
            fingerprint=self.fingerprint(), run_id=self.run_id,
            resources=lambda: admission.resources(self, stage, inputs))

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

    def _settle(self, job: executors.Job, outcome: executors.Outcome, why: Optional[str], span: dict) -> Optional[str]:
        """Store what was made here; restore what was published elsewhere (None when that cannot
        be done for a record another builder published, which is then built here)."""
        stage = job.stage
        if isinstance(outcome, executors.Made):
            self.store_result(stage, job.key, job.inputs, outcome.result, started=outcome.started, why=why,
                              peak_rss=outcome.peak_rss, written_bytes=outcome.written_bytes,
                              peak_private=outcome.peak_private)
            return "ran"
        span.update(outcome.span)
        if outcome.stamped:
            return outcome.status
        record, tier = self.store.actions.lookup(outcome.key, take=True)
        status = self.restore(stage, job.key, job.inputs, record, tier) if record is not None else None
        if status is None and outcome.status:
            where = self.store.remote.where if self.store.remote is not None else "none"
            raise CudabuildError(f"stage {stage.id} {outcome.status} {outcome.by}, but its record {job.key[:12]} is not in "
                                 f"the shared tier {where}: start the workers with the driver's CUDABUILD_REMOTE")
        if status is None or not outcome.status:
            return status
        # Run (or found built) for this build elsewhere: the stamp says where, for how long and why.
        restored = self.require_stamp(stage)
        ran = outcome.status == "ran"
        self.write_stamp(stage, restored.replace(
            status=outcome.status, seconds=outcome.seconds if ran else 0.0, reason=outcome.reason if ran else None,
            peak_rss=outcome.peak_rss if ran else None, saved_seconds=None if ran else restored.saved_seconds,
            worker=outcome.worker))
        return outcome.status

    def execute_here(self, stage: Stage) -> str:
        """execute() without a stage span of its own: for a process that runs a stage for another,
        whose span covers it (cudabuild.warm_stage)."""
        with self.recorder.active():
            return self._execute(stage, {})

    def _note(self, stage: Stage, status: str) -> str:
        self.statuses[stage.id] = status
        return status

    def restore(self, stage: Stage, key: str, inputs: dict, record: dict, source: str) -> Optional[str]:
        """Serve a record found for the key in tier `source`: restored (from this cache), remote (the
        record or a final output came from the shared tier), or None when its blobs turn out unusable."""
        finals = record.get("finals", [])
        if not all(self.store.objects.has_blob(record["outputs"][name]) for name in finals):
            source = "remote"
        try:
            for name in finals:
                self.store.objects.fetch(record["outputs"][name], self.config.build_dir / name)
                self.store.hasher.remember(self.config.build_dir / name, record["outputs"][name])
        except (CorruptBlob, MissingBlob) as e:
            terminal.warn(str(e))
            self.store.actions.drop_record(key)
            return None
        status = "remote" if source == "remote" else "restored"
        self.write_stamp(stage, Stamp(
            key=key, inputs=inputs, digest=record["digest"], outputs=record["outputs"], finals=finals,
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
                     peak_private: Optional[int] = None) -> None:
        """What a stage that ran here made, stored: its files into the store (its final outputs
        into build/ too), the record, then the stamp; then written back to the shared tier. Called
        while the stage's work directory still holds its files."""
        finals = sorted(result.files) if self.pipeline.final_outputs(stage) else []
        with trace.phase("store writes"):
            # A work file is moved into the cache, not copied (a weights bundle of tens of GB is
            # never on the disk twice); a final output stays, for build/ (below).
            outputs = {name: self.store.objects.put_file(path, result.known.get(name), result.regions.get(name),
                                                 take=name not in finals)
                       for name, path in sorted(result.files.items())}
            outputs.update(self._stored(stage, result.stored))
        seconds = round(time.monotonic() - started, 3)
        stage_digest = result.digest or digest(outputs)
        record = {"stage": stage.id, "digest": stage_digest, "outputs": outputs, "finals": finals,
                  "value": result.value, "seconds": seconds}
        for name in finals:
            # Moved where it can be (the work folder goes next): the .ptd the cache keeps as ranges
            # of the weights is then on the disk once, in build/.
            move_or_copy(result.files[name], self.config.build_dir / name)
            self.store.hasher.remember(self.config.build_dir / name, outputs[name])
        self.store.actions.put_record(key, record)
        self.write_stamp(stage, Stamp(
            key=key, inputs=inputs, digest=stage_digest, outputs=outputs, finals=finals, value=result.value,
            status="ran", seconds=seconds, run=self.run_id, reason=why, peak_rss=peak_rss, written_bytes=written_bytes,
            peak_private=peak_private,
        ))
        if self.store.remote is not None and (self.store.remote.writable or self.publish_required):
            with trace.phase("upload"):
                why = self.store.actions.publish(key, record)  # write-back to the shared tier: blobs, then the record
            if why is not None:
                self._not_published(stage, key, why)

    def _not_published(self, stage: Stage, key: str, why: str) -> None:
        """Said where it happens: a result the shared tier did not take. Where it had to (a cluster's
        worker, whose driver restores it from there), the stage fails; else a warning (this cache
        keeps it; other machines build it themselves)."""
        where = self.store.remote.where
        if self.publish_required:
            raise CudabuildError(f"stage {stage.id}: its result {key[:12]} was not written to the shared tier {where} "
                                 f"({why}), so the driver cannot restore it; fix the tier (its warning says what "
                                 "failed) and build again")
        terminal.warn(f"stage {stage.id}: its result {key[:12]} was not written to the shared tier {where} ({why}); "
                      "this cache keeps it, other machines will build it themselves")

    def keep_file(self, path: Path, sha: Optional[str] = None, regions: Optional[list] = None) -> str:
        """A running stage's file stored now (StageContext.keep); the work folder no longer holds it."""
        sha = self.store.objects.put_file(path, sha, regions, take=True)
        Path(path).unlink(missing_ok=True)  # kept as ranges of other blobs: not taken
        return sha

    def _stored(self, stage: Stage, stored: dict[str, str]) -> dict[str, str]:
        """Outputs handed on from upstream unchanged: blobs this cache holds, or the shared tier
        does (on a cluster's worker whose upstream stage ran on another worker, the blob is there
        only; ActionCache.push then leaves it where it is). One that is in neither (found corrupt and
        dropped since its producer stored it: a stage that hands a compiled .so on never reads it)
        has its producer run again, as a bad blob a stage reads does (_serve); the stage may hand
        on what that makes only when it is the same bytes, since what else the stage made was made
        with the old ones."""
        remote = self.store.remote
        in_remote = lambda shas: remote is not None and remote.has_blobs(shas)  # noqa: E731
        missing = sorted(name for name, sha in stored.items() if not self.store.objects.has_blob(sha))
        if not missing or in_remote([stored[name] for name in missing]):  # one question for them all
            return dict(stored)
        where = f"the cache at {self.store.root}" + (f" or the shared tier {remote.where}" if remote is not None else "")
        for name in missing:
            sha = stored[name]
            if in_remote([sha]):
                continue
            producer = self._producer_of(stage, sha)
            if producer is None:
                raise CudabuildError(f"stage {stage.id} handed on {name}, which is no longer in {where}")
            self._rebuild(producer[0])
            again = self._sha_of(*producer)
            if again != sha or not self.store.objects.has_blob(sha):
                raise CudabuildError(f"stage {stage.id} handed on {name} of {producer[0].id}, which was no longer in "
                                     f"{where}; made again, it is other bytes ({again[:12]}, not {sha[:12]}): build "
                                     "again, and the stage runs on the new one")
        return dict(stored)

    # -- reading upstream outputs ----------------------------------------------------------------

    def _sha_of(self, stage: Stage, name: str) -> str:
        stamp = self.require_stamp(stage)
        try:
            return stamp.outputs[name]
        except KeyError:
            raise CudabuildError(f"stage {stage.id} has no output named {name}") from None

    def _rebuild(self, stage: Stage) -> None:
        """Bring a producer up to date again, through the build's executor, because an output it
        recorded can no longer be served here. Its record and stamp go first, so whoever runs it
        decides afresh: it runs, or its record is taken from the shared tier, whose copy of the
        output is fetched and checked again on the next read."""
        stamp = self.read_stamp(stage)
        if stamp:
            self.store.actions.drop_record(stamp.key)
        self.stamp_path(stage).unlink(missing_ok=True)
        inputs = self.inputs(stage)
        key = digest(inputs)
        self.log(f"{stage.id}: a cached output was missing or corrupt; running it again")
        status = self._run(self._job(stage, key, inputs, nested=True), "a cached output was missing or corrupt", {})
        self.statuses[stage.id] = status

    def _serve(self, stage: Stage, name: str, take: Callable[[str], object]):
        """`take(sha)` of an upstream output; when the blob is corrupt or gone, its producer runs
        again and the new blob is taken instead."""
        try:
            return take(self._sha_of(stage, name))
        except (CorruptBlob, MissingBlob) as e:
            terminal.warn(str(e))
            self._rebuild(stage)
            return take(self._sha_of(stage, name))

    def read_output(self, stage: Stage, name: str) -> bytes:
        return self._serve(stage, name, self.store.objects.read_bytes)

    def fetch_output(self, stage: Stage, name: str, dest: Path) -> Path:
        return self._serve(stage, name, lambda sha: self.store.objects.fetch(sha, dest))

    def output_path(self, stage: Stage, name: str) -> Path:
        return self._serve(stage, name, self.store.objects.verified_path)

    def _producer_of(self, consumer: Stage, sha: str) -> Optional[tuple[Stage, str]]:
        """(the upstream stage of `consumer` that recorded an output with this sha256, its name), or None."""
        for upstream in self.pipeline.dependencies(consumer, self.config):
            stamp = self.read_stamp(upstream)
            name = next((n for n, s in sorted(stamp.outputs.items()) if s == sha), None) if stamp else None
            if name is not None:
                return upstream, name
        return None

    def output_path_of_sha(self, consumer: Stage, sha: str) -> Path:
        """output_path of the output with this sha256 among those of `consumer`'s upstream stages."""
        producer = self._producer_of(consumer, sha)
        if producer is None:
            raise CudabuildError(f"stage {consumer.id} reads blob {sha[:12]}, which none of the stages it depends on made")
        return self.output_path(*producer)

    @contextlib.contextmanager
    def output_file(self, stage: Stage, name: str):
        """A private file of an upstream output for the block (ObjectStore.blob_file), its producer run
        again where the blob is bad, as `_serve` does."""
        with contextlib.ExitStack() as stack:
            try:
                path = stack.enter_context(self.store.objects.blob_file(self._sha_of(stage, name), for_name=name))
            except (CorruptBlob, MissingBlob) as e:
                terminal.warn(str(e))
                self._rebuild(stage)
                path = stack.enter_context(self.store.objects.blob_file(self._sha_of(stage, name), for_name=name))
            yield path

    def mapped_output(self, stage: Stage, name: str):
        return self._serve(stage, name, self.store.objects.mapped_parts)

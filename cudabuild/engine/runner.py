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
   a cluster's worker, with the key's lock, the lease and the admission that go with each);
   `store_result` puts its outputs into the store, then the record, then the stamp, and writes
   it back to the shared tier. An output that was needed but turns out corrupt or missing makes
   its producer run again, never served.

Owns the decision, restoring, storing and serving upstream outputs to a stage. Must not touch: how
a stage runs (executors.py), the manifest (manifest.py), the cache's size (cache_admin.py, once a
build ends).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cudabuild.engine import executors
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.context import StageResult
from cudabuild.errors import CorruptBlob, CudabuildError, MissingBlob
from cudabuild.engine.files import atomic_copy
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

    def checkpoint_digest(self, folder=None) -> Optional[dict]:
        """The digest of `folder` (default: the build's checkpoint), file by file and, for files
        the pipeline can split, part by part; None without a folder."""
        folder = Path(folder).expanduser().resolve() if folder else self.config.checkpoint
        return self.store.hasher.tree(folder, parts=self.pipeline.content_digests) if folder else None

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
        the key up in the store (a build uses Store.find_record, explain the side-effect-free
        Store.locate_record); without it the store is not consulted and a restorable stage reads
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

    def output_of(self, stage: Stage):
        """Where the stage's third-party output goes while it runs: its log, or the console."""
        if not self.capture_output:
            return contextlib.nullcontext()
        self.logs[stage.id] = self.log_path(stage)
        return terminal.capture(self.logs[stage.id])

    # -- execution -----------------------------------------------------------------------------

    def execute(self, stage: Stage) -> str:
        """Bring one stage up to date; returns ran, cached, restored or remote."""
        self.record_startup()
        with self.recorder.span(stage.id, "stage", step="execute") as span:
            span["status"] = status = self._execute(stage, span)
        return status

    def _execute(self, stage: Stage, span: dict) -> str:
        decision = self.decide(stage, find=self.store.find_record)
        span["key"] = decision.key
        if decision.verdict == "cached":
            return self._note(stage, "cached")
        if decision.verdict == "restorable":
            status = self.restore(stage, decision.key, decision.inputs, decision.record, decision.tier)
            if status:
                return self._note(stage, status)
        return self._note(stage, self.executor.run(self, stage, decision, span))

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
        if not all(self.store.has_blob(record["outputs"][name]) for name in finals):
            source = "remote"
        try:
            for name in finals:
                self.store.fetch(record["outputs"][name], self.config.build_dir / name)
                self.store.hasher.remember(self.config.build_dir / name, record["outputs"][name])
        except (CorruptBlob, MissingBlob) as e:
            terminal.warn(str(e))
            self.store.drop_record(key)
            return None
        status = "remote" if source == "remote" else "restored"
        self.write_stamp(stage, Stamp(
            key=key, inputs=inputs, digest=record["digest"], outputs=record["outputs"], finals=finals,
            value=record.get("value"), status=status, seconds=0.0, saved_seconds=record.get("seconds", 0.0),
            run=self.run_id,
        ))
        return status

    def store_result(self, stage: Stage, key: str, inputs: dict, result: StageResult, started: float,
                     why: Optional[str], peak_rss: Optional[int]) -> None:
        """What a stage that ran here made, stored: its files into the store (its final outputs
        into build/ too), the record, then the stamp; then written back to the shared tier. Called
        while the stage's work directory still holds its files."""
        with trace.phase("store writes"):
            outputs = {name: self.store.put_file(path, result.known.get(name), result.regions.get(name))
                       for name, path in sorted(result.files.items())}
            outputs.update(self._stored(stage, result.stored))
        seconds = round(time.monotonic() - started, 3)
        stage_digest = result.digest or digest(outputs)
        finals = sorted(result.files) if self.pipeline.final_outputs(stage) else []
        record = {"stage": stage.id, "digest": stage_digest, "outputs": outputs, "finals": finals,
                  "value": result.value, "seconds": seconds}
        for name in finals:
            atomic_copy(result.files[name], self.config.build_dir / name)
            self.store.hasher.remember(self.config.build_dir / name, outputs[name])
        self.store.put_record(key, record)
        self.write_stamp(stage, Stamp(
            key=key, inputs=inputs, digest=stage_digest, outputs=outputs, finals=finals, value=result.value,
            status="ran", seconds=seconds, run=self.run_id, reason=why, peak_rss=peak_rss,
        ))
        if self.store.remote is not None:
            with trace.phase("upload"):
                self.store.push(key, record)  # write-back to the shared tier: blobs, then the record

    def _stored(self, stage: Stage, stored: dict[str, str]) -> dict[str, str]:
        """Outputs handed on from upstream unchanged: blobs this cache holds, or the shared tier
        does (on a cluster's worker whose upstream stage ran on another worker, the blob is there
        only; Store.push then leaves it where it is)."""
        missing = sorted(name for name, sha in stored.items() if not self.store.has_blob(sha))
        remote = self.store.remote
        if missing and not (remote is not None and remote.has_blobs([stored[name] for name in missing])):
            where = f"the cache at {self.store.root}" + (f" or the shared tier {remote.where}" if remote is not None else "")
            raise CudabuildError(f"stage {stage.id} handed on {missing[0]}, which is no longer in {where}")
        return dict(stored)

    # -- reading upstream outputs ----------------------------------------------------------------

    def _sha_of(self, stage: Stage, name: str) -> str:
        stamp = self.require_stamp(stage)
        try:
            return stamp.outputs[name]
        except KeyError:
            raise CudabuildError(f"stage {stage.id} has no output named {name}") from None

    def _rebuild(self, stage: Stage) -> None:
        """Run a producer again because an output it recorded can no longer be served."""
        stamp = self.read_stamp(stage)
        if stamp:
            self.store.drop_record(stamp.key)
        inputs = self.inputs(stage)
        key = digest(inputs)
        self.log(f"{stage.id}: a cached output was missing or corrupt; running it again")
        with executors.key_lock(self.store, key):
            executors.run_here(self, stage, key, inputs, "a cached output was missing or corrupt")
        self.statuses[stage.id] = "ran"

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
        return self._serve(stage, name, self.store.read_bytes)

    def fetch_output(self, stage: Stage, name: str, dest: Path) -> Path:
        return self._serve(stage, name, lambda sha: self.store.fetch(sha, dest))

    def output_path(self, stage: Stage, name: str) -> Path:
        return self._serve(stage, name, self.store.verified_path)

    @contextlib.contextmanager
    def output_file(self, stage: Stage, name: str):
        """A private file of an upstream output for the block (Store.blob_file), its producer run
        again where the blob is bad, as `_serve` does."""
        with contextlib.ExitStack() as stack:
            try:
                path = stack.enter_context(self.store.blob_file(self._sha_of(stage, name), for_name=name))
            except (CorruptBlob, MissingBlob) as e:
                terminal.warn(str(e))
                self._rebuild(stage)
                path = stack.enter_context(self.store.blob_file(self._sha_of(stage, name), for_name=name))
            yield path

    def mapped_output(self, stage: Stage, name: str):
        return self._serve(stage, name, self.store.mapped_parts)

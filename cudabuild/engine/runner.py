"""Running one stage against the cache: cached, restored from the store, or executed and stored.

For a stage with action key K (the digest of its inputs, see graph.py):
1. `cached`: its stamp in build/<model>/<target>/.stamps/ holds K, and its final outputs in build/
   still have the recorded hashes (checked by stat through the hash memo). Nothing is done.
2. `restored`: the store has a record for K whose blobs are all present: the stamp is rewritten
   from the record and final outputs copied back (each blob re-hashed on the way). Intermediate
   artifacts stay in the store until a stage that runs needs them.
3. `ran`: the stage function runs in a fresh work directory; its outputs go into the store, then
   the record, then the stamp. An output that was needed but turns out corrupt or missing makes
   its producer run again, never served.
   `remote`: like restored, but the record or a final output came from the shared tier
   ($CUDABUILD_REMOTE, see remote.py); a stage that ran is written back to that tier.
Execution of one key is serialised across processes with an flock, so two builds sharing a cache
never compile the same key at the same time; the second one restores what the first stored. With
a shared tier, a lease there does the same across machines (see `_claim`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import itertools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cudabuild.engine import console, graph, trace
from cudabuild.config import BuildConfig
from cudabuild.errors import CorruptBlob, CudabuildError, MissingBlob
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.engine.files import atomic_copy, atomic_write_text
from cudabuild.engine.graph import Stage
from cudabuild.engine.hashing import digest
from cudabuild.engine.store import Store
from cudabuild.backend.toolchain import cheap_fingerprint

STAGE_MODULES = {kind: f"cudabuild.backend.stages.{kind}" for kind in graph.KINDS}


@dataclass
class StageResult:
    """What a stage function returns: files it wrote (name -> path), its semantic digest and value."""

    files: dict[str, Path]
    digest: Optional[str] = None
    value: Optional[dict] = None


@dataclass
class StageContext:
    config: BuildConfig
    stage: Stage
    inputs: dict
    key: str
    workdir: Path
    runner: "Runner"
    log: Callable[[str], None] = console.note

    @property
    def store(self) -> Store:
        return self.runner.store

    def upstream(self, kind: str, method: Optional[str] = None) -> dict:
        return self.runner.require_stamp(Stage(kind, method))

    def blob(self, kind: str, method: Optional[str], name: str) -> bytes:
        """An upstream output's bytes, verified; rebuilds the producer if the blob is bad."""
        return self.runner.read_output(Stage(kind, method), name)

    def fetch(self, kind: str, method: Optional[str], name: str, dest: Path) -> Path:
        return self.runner.fetch_output(Stage(kind, method), name, dest)


@dataclass
class Runner:
    config: BuildConfig
    store: Store
    run_id: str
    log: Callable[[str], None] = console.note
    statuses: dict = field(default_factory=dict)  # stage id -> status for this process
    # Third-party output of a stage that runs goes to its log (cudabuild.engine.console), unless streamed.
    capture_output: bool = True
    logs: dict = field(default_factory=dict)  # stage id -> the log this process's run of it wrote
    _fingerprint: Optional[dict] = None
    _recorder: Optional[trace.Recorder] = None
    _started_in: int = field(default_factory=os.getpid)
    _startup_recorded: bool = False

    # -- stamps ---------------------------------------------------------------------------------

    @property
    def stamps_dir(self) -> Path:
        return self.config.build_dir / ".stamps"

    def stamp_path(self, stage: Stage) -> Path:
        return self.stamps_dir / f"{stage.id}.json"

    def read_stamp(self, stage: Stage) -> Optional[dict]:
        try:
            return json.loads(self.stamp_path(stage).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def require_stamp(self, stage: Stage) -> dict:
        stamp = self.read_stamp(stage)
        if stamp is None:
            raise CudabuildError(f"stage {stage.id} has not been built yet for {self.config.model}/{self.config.target}")
        return stamp

    def _write_stamp(self, stage: Stage, stamp: dict) -> None:
        atomic_write_text(self.stamp_path(stage), json.dumps(stamp, indent=1, sort_keys=True))

    # -- keys ----------------------------------------------------------------------------------

    def fingerprint(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = cheap_fingerprint(self.config.target)
        return self._fingerprint

    def checkpoint_digest(self) -> Optional[dict]:
        folder = self.config.checkpoint
        return self.store.hasher.tree(folder) if folder else None

    def inputs(self, stage: Stage) -> dict:
        return graph.stage_inputs(stage, self.config, self.read_stamp, self.fingerprint, self.checkpoint_digest)

    def key(self, stage: Stage) -> str:
        return digest(self.inputs(stage))

    # -- up-to-date ----------------------------------------------------------------------------

    def finals_intact(self, stamp: dict) -> bool:
        for name in stamp.get("finals", []):
            if self.store.hasher(self.config.build_dir / name) != stamp["outputs"][name]:
                return False
        return True

    def is_up_to_date(self, stage: Stage) -> bool:
        self._record_startup()
        start = trace.now_us()
        stamp = self.read_stamp(stage)
        key = self.key(stage)
        fresh = bool(stamp) and stamp.get("key") == key and self.finals_intact(stamp)
        args = {"status": "cached", "key": key} if fresh else {}
        self.recorder.complete(stage.id, start, trace.now_us(), "stage", step="check", **args)
        return fresh

    # -- timeline and logs ---------------------------------------------------------------------

    @property
    def recorder(self) -> trace.Recorder:
        if self._recorder is None:
            self._recorder = trace.Recorder(self.config.build_dir, self.run_id)
        return self._recorder

    def _record_startup(self) -> None:
        """The span from the process's start to its first stage: imports, configuration, planning."""
        if not self._startup_recorded and os.getpid() == self._started_in:
            self._startup_recorded = True
            self.recorder.complete("startup", trace.process_start_us(), trace.now_us(), "build")

    def expected_seconds(self, stage: Stage) -> Optional[float]:
        """How long the stage's last run took, for progress: its stamp's, else the newest logged
        build of this model and target that ran it."""
        stamp = self.read_stamp(stage) or {}
        seconds = stamp.get("seconds") if stamp.get("status") == "ran" else stamp.get("saved_seconds")
        if seconds:
            return float(seconds)
        for entry in reversed(self.store.build_log(last=50)):
            if (entry.get("model"), entry.get("target")) != (self.config.model, self.config.target):
                continue
            for row in entry.get("stages", []):
                if (row.get("stage"), row.get("method"), row.get("status")) == (stage.kind, stage.method, "ran"):
                    return float(row.get("seconds") or 0.0) or None
        return None

    def log_path(self, stage: Stage) -> Path:
        return self.config.build_dir / "logs" / f"{stage.id}.log"

    def _output_of(self, stage: Stage):
        """Where the stage's third-party output goes while it runs: its log, or the console."""
        if not self.capture_output:
            return contextlib.nullcontext()
        self.logs[stage.id] = self.log_path(stage)
        return console.capture(self.logs[stage.id])

    # -- execution -----------------------------------------------------------------------------

    def execute(self, stage: Stage) -> str:
        """Bring one stage up to date; returns ran, cached, restored or remote."""
        self._record_startup()
        with self.recorder.span(stage.id, "stage", step="execute") as span:
            span["status"] = status = self._execute(stage, span)
        return status

    def _execute(self, stage: Stage, span: dict) -> str:
        inputs = self.inputs(stage)
        key = digest(inputs)
        span["key"] = key
        old = self.read_stamp(stage)
        if old and old.get("key") == key and self.finals_intact(old):
            return self._note(stage, "cached")
        if status := self._restore(stage, key, inputs):
            return self._note(stage, status)
        with self._key_lock(key):
            # Another process may have built this key while we waited for the lock, and another
            # machine may be building it now.
            status, lease = self._claim(stage, key, inputs)
            if status:
                return self._note(stage, status)
            why = explain_reason(old.get("inputs") if old else None, inputs)
            with lease:
                self._run(stage, key, inputs, why)
        return self._note(stage, "ran")

    def _claim(self, stage: Stage, key: str, inputs: dict):
        """(status, None) when the key can be restored now, else (None, a lease to build under).

        Without a shared tier the lease is a no-op. With one, it is the key's build lease there
        (build-once across machines): while another builder holds it, wait until its record
        appears or the lease goes (released, or lapsed because the holder died), then restore or
        take the lease over. After $CUDABUILD_REMOTE_WAIT_SECONDS of waiting, build anyway.
        """
        remote = self.store.remote
        deadline = time.monotonic() + (remote.wait_seconds if remote is not None else 0.0)
        for polls in itertools.count():
            lease = remote.try_lease(key) if remote is not None else None
            # Restore after claiming: the holder may have published and let go since our last look.
            if status := self._restore(stage, key, inputs):
                if lease is not None:
                    lease.release()
                return status, None
            if lease is not None or remote is None:
                return None, lease or contextlib.nullcontext()
            if time.monotonic() >= deadline:
                self.log(f"{stage.id}: gave up waiting for another builder of {key[:12]}; building it here")
                return None, contextlib.nullcontext()
            if not polls:
                self.log(f"{stage.id}: another builder is building {key[:12]}; waiting for its result")
            remote.wait_for_result(key, deadline)

    def _note(self, stage: Stage, status: str) -> str:
        self.statuses[stage.id] = status
        return status

    def _restore(self, stage: Stage, key: str, inputs: dict) -> Optional[str]:
        """restored (from this cache), remote (the record or a final output came from the shared
        tier), or None when the key cannot be restored."""
        record, source = self.store.find_record(key)
        if record is None:
            return None
        finals = record.get("finals", [])
        if not all(self.store.has_blob(record["outputs"][name]) for name in finals):
            source = "remote"
        try:
            for name in finals:
                self.store.fetch(record["outputs"][name], self.config.build_dir / name)
        except (CorruptBlob, MissingBlob) as e:
            console.warn(str(e))
            self.store.drop_record(key)
            return None
        status = "remote" if source == "remote" else "restored"
        self._write_stamp(stage, {
            "key": key, "inputs": inputs, "digest": record["digest"], "outputs": record["outputs"],
            "finals": finals, "value": record.get("value"), "status": status, "seconds": 0.0,
            "saved_seconds": record.get("seconds", 0.0), "run": self.run_id, "reason": None,
        })
        return status

    def _run(self, stage: Stage, key: str, inputs: dict, why: str) -> None:
        module = importlib.import_module(STAGE_MODULES[stage.kind])
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"cudabuild-{stage.id}-") as tmp:
            ctx = StageContext(self.config, stage, inputs, key, Path(tmp), self, self.log)
            with trace.phase("run"), self._output_of(stage):
                result: StageResult = module.run(ctx)
            with trace.phase("store writes"):
                outputs = {name: self.store.put_file(path) for name, path in sorted(result.files.items())}
            seconds = round(time.monotonic() - start, 3)
            stage_digest = result.digest or digest(outputs)
            finals = sorted(result.files) if graph.final_outputs(stage) else []
            record = {"stage": stage.id, "digest": stage_digest, "outputs": outputs, "finals": finals,
                      "value": result.value, "seconds": seconds}
            for name in finals:
                atomic_copy(result.files[name], self.config.build_dir / name)
        self.store.put_record(key, record)
        self._write_stamp(stage, {
            "key": key, "inputs": inputs, "digest": stage_digest, "outputs": outputs, "finals": finals,
            "value": result.value, "status": "ran", "seconds": seconds, "run": self.run_id, "reason": why,
        })
        if self.store.remote is not None:
            with trace.phase("upload"):
                self.store.push(key, record)  # write-back to the shared tier: blobs, then the record
        self.store.enforce_limit(self.config.project)

    @contextlib.contextmanager
    def _key_lock(self, key: str):
        lock_dir = self.store.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / key[:16], "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # -- reading upstream outputs ----------------------------------------------------------------

    def _sha_of(self, stage: Stage, name: str) -> str:
        stamp = self.require_stamp(stage)
        try:
            return stamp["outputs"][name]
        except KeyError:
            raise CudabuildError(f"stage {stage.id} has no output named {name}") from None

    def _rebuild(self, stage: Stage) -> None:
        """Run a producer again because an output it recorded can no longer be served."""
        stamp = self.read_stamp(stage)
        if stamp:
            self.store.drop_record(stamp["key"])
        inputs = self.inputs(stage)
        key = digest(inputs)
        self.log(f"{stage.id}: a cached output was missing or corrupt; running it again")
        with self._key_lock(key):
            self._run(stage, key, inputs, "a cached output was missing or corrupt")
        self.statuses[stage.id] = "ran"

    def _serve(self, stage: Stage, name: str, take: Callable[[str], object]):
        """`take(sha)` of an upstream output; when the blob is corrupt or gone, its producer runs
        again and the new blob is taken instead."""
        try:
            return take(self._sha_of(stage, name))
        except (CorruptBlob, MissingBlob) as e:
            console.warn(str(e))
            self._rebuild(stage)
            return take(self._sha_of(stage, name))

    def read_output(self, stage: Stage, name: str) -> bytes:
        return self._serve(stage, name, self.store.read_bytes)

    def fetch_output(self, stage: Stage, name: str, dest: Path) -> Path:
        return self._serve(stage, name, lambda sha: self.store.fetch(sha, dest))

    # -- manifest ------------------------------------------------------------------------------

    def manifest(self) -> dict:
        stages = []
        outputs = {}
        verify = {}
        for stage in graph.plan(self.config):
            stamp = self.read_stamp(stage) or {}
            this_run = stamp.get("run") == self.run_id
            # What this process did, not what the stamp says now: another build of the same project
            # may have rewritten the stamp since (its restore of what we ran), which made a stage
            # this build compiled read as "cached" and the other's "restored": no "ran" at all.
            # Under `doit -n` stages run in worker processes: their statuses reach us only through
            # the stamps they wrote with this run's id.
            status = self.statuses.get(stage.id) or (stamp.get("status") if this_run else None) or "cached"
            entry = {"stage": stage.kind, "method": stage.method, "key": stamp.get("key"), "status": status,
                     "seconds": stamp.get("seconds", 0.0) if this_run else 0.0}
            if this_run and stamp.get("reason"):
                entry["reason"] = stamp["reason"]
            if status in ("restored", "remote", "cached"):
                entry["saved_seconds"] = stamp.get("saved_seconds", stamp.get("seconds", 0.0))
            stages.append(entry)
            for name in stamp.get("finals", []):
                outputs[name] = stamp["outputs"][name]
            if stage.kind == "verify" and stamp.get("value"):
                verify[stage.method] = stamp["value"]
        probe = self.read_stamp(Stage("probe")) or {}
        return {"model": self.config.model, "target": self.config.target, "options": dict(self.config.options),
                "specs": {m: dict(s) for m, s in self.config.specs.items()}, "toolchain": probe.get("value"),
                "stages": stages, "outputs": dict(sorted(outputs.items())), "verify": verify}

    def pin_autotune(self) -> Path:
        """`autotune=pin`: write every method's tuning decisions to recipes/<model>.autotune.json.

        The compile stamps are then re-keyed to the inputs that name the new pin: replaying the
        decisions a compile just made reproduces that compile, so nothing is rebuilt for it.
        """
        from cudabuild.backend.tuning import write_pins

        entries = {}
        for method in self.config.methods:
            data = json.loads(self.read_output(Stage("compile", method), "autotune.json"))
            entries[method] = {"tuning_key": data["tuning_key"], "files": data["files"]}
        path = write_pins(self.config.project, self.config.model, self.config.target, entries)
        for method in self.config.methods:
            stage = Stage("compile", method)
            stamp = self.require_stamp(stage)
            inputs = self.inputs(stage)
            key = digest(inputs)
            if key == stamp["key"]:
                continue
            record = {k: stamp[k] for k in ("digest", "outputs", "finals", "value", "seconds")}
            self.store.put_record(key, dict(record, stage=stage.id))
            self._write_stamp(stage, dict(stamp, key=key, inputs=inputs))
        return path

    def write_manifest(self) -> dict:
        """After every stage succeeded: manifest.json, the build log, and no stale failure reports."""
        manifest = self.manifest()
        atomic_write_text(self.config.build_dir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=False))
        for method in manifest["verify"]:  # each verified now: an earlier failure's report is history
            (self.config.build_dir / f"verify-{method}.failed.json").unlink(missing_ok=True)
        self.store.record_build(manifest)
        return manifest

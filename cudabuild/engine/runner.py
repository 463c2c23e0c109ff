"""Running one stage against the cache: cached, restored from the store, or executed and stored.

For a stage with action key K (the digest of its inputs, see graph.py), `decide` climbs one ladder,
the same for a build, doit's up-to-date check and `cudabuild explain`:
1. `cached`: its stamp in build/<model>/<target>/.stamps/ holds K, and its final outputs in build/
   still have the recorded hashes (checked by stat through the hash memo). Nothing is done.
2. `restored`: the store has a record for K whose blobs are all present: the stamp is rewritten
   from the record and final outputs put back in build/ (each blob checked against its hash, once
   per change of its file; reflinked where the filesystem can, else copied by the kernel: never
   linked, so editing build/ cannot touch the cache). Intermediate artifacts stay in the store
   until a stage that runs needs them; big ones are then mapped from it, not read (blob_path).
3. `ran`: the stage function runs in a fresh work directory; its outputs go into the store, then
   the record, then the stamp. An output that was needed but turns out corrupt or missing makes
   its producer run again, never served.
   `remote`: like restored, but the record or a final output came from the shared tier
   ($CUDABUILD_REMOTE, see cudabuild.engine.tiers); a stage that ran is written back to that tier.
Execution of one key is serialised across processes with an flock, so two builds sharing a cache
never compile the same key at the same time; the second one restores what the first stored. With
a shared tier, a lease there does the same across machines (see `_claim`). Every wait of a stage
(those, and its memory admission and device lock) is a named span of the trace (WAITS).
With a `delegate` (a Dask cluster's, cudabuild.engine.cluster), a stage that must run is run by a
worker instead, which publishes it to the shared tier; it is then restored from there like any
record, its stamp saying it ran, where, and how long it took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import importlib
import itertools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from cudabuild.engine import cache_admin, cluster, memory, workers
from cudabuild.engine.console import terminal, trace
from cudabuild.errors import CorruptBlob, CudabuildError, MissingBlob
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.engine.files import atomic_copy, atomic_write_text
from cudabuild.engine.graph import Build, Pipeline, Result, ResultReader, Stage, pending_in
from cudabuild.engine.hashing import digest
from cudabuild.engine.stamp import Stamp, stamps_dir
from cudabuild.engine.store import Store


# What a stage may wait for, each a span of its own in trace.json (category "wait"), recorded
# whether it waited or not: its turn for memory beside the build's other stages (workers.py), the
# device's lock, the key's lock (another process of this machine building the same key), the key's
# lease on the shared tier (another machine building it), a warm process to take its call.
WAITS = {"memory": "wait: memory admission", "device": "wait: device lock", "key": "wait: key lock",
         "lease": "wait: lease", "warm": "wait: warm process"}


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
class StageResult:
    """What a stage function returns: files it wrote (name -> path), its semantic digest and value.

    `known` gives the sha256 of files the stage hashed already (so they are not read again);
    `stored` names outputs that are blobs already in the store (name -> sha256), handed on from
    upstream unchanged and so neither written nor hashed: a stage need not copy gigabytes of
    weights it did not change.
    """

    files: dict[str, Path]
    digest: Optional[str] = None
    value: Optional[dict] = None
    known: dict[str, str] = field(default_factory=dict)
    stored: dict[str, str] = field(default_factory=dict)


@dataclass
class StageContext:
    config: Build
    stage: Stage
    inputs: dict
    key: str
    workdir: Path
    runner: "Runner"
    log: Callable[[str], None] = terminal.note

    @property
    def store(self) -> Store:
        return self.runner.store

    def upstream(self, kind: str, method: Optional[str] = None) -> Stamp:
        return self.runner.require_stamp(Stage(kind, method))

    def blob(self, kind: str, method: Optional[str], name: str) -> bytes:
        """An upstream output's bytes, verified; rebuilds the producer if the blob is bad."""
        return self.runner.read_output(Stage(kind, method), name)

    def blob_path(self, kind: str, method: Optional[str], name: str) -> Path:
        """The store's own file of an upstream output, verified: to read or memory-map, never to
        write. For outputs of gigabytes, which `blob` would copy into memory."""
        return self.runner.output_path(Stage(kind, method), name)

    def reader(self, kind: str, method: Optional[str]) -> Callable[[str], Path]:
        """`blob_path` of one upstream stage's outputs by name, with `.sha(name)` their sha256."""
        read = functools.partial(self.blob_path, kind, method)
        read.sha = lambda name: self.upstream(kind, method).outputs[name]
        return read

    def fetch(self, kind: str, method: Optional[str], name: str, dest: Path) -> Path:
        return self.runner.fetch_output(Stage(kind, method), name, dest)


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
    # Where a stage that must run is run, when not here: (label, work, resources) -> the outcome its
    # worker reports, once its record is in the shared tier (cudabuild.engine.cluster.Pool.delegate).
    delegate: Optional[Callable[[str, dict, dict], dict]] = None
    # Where a stage that must run is run on this machine, when not in this process: stage -> the
    # outcome of running it in a warm process, one that imported torch already (a fork, or a spare)
    # (cudabuild.engine.warm; cudabuild.warm_stage makes this function). None: here.
    warm: Optional[Callable[[Stage], dict]] = None
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

    def _write_stamp(self, stage: Stage, stamp: Stamp) -> None:
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
        self._record_startup()
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

    def _record_startup(self) -> None:
        """The span from the process's start to its first stage: imports, configuration, planning."""
        if not self._startup_recorded and os.getpid() == self._started_in:
            self._startup_recorded = True
            self.recorder.complete("startup", trace.process_start_us(), trace.now_us(), "build")

    def expected_seconds(self, stage: Stage) -> Optional[float]:
        """How long the stage's last run took, for progress: its stamp's, else the newest logged
        build of this model and target that ran it."""
        stamp = self.read_stamp(stage)
        seconds = stamp and (stamp.seconds if stamp.status == "ran" else stamp.saved_seconds)
        if seconds:
            return float(seconds)
        row = next((r for r in self._logged_rows(stage) if r.get("status") == "ran"), None)
        return (float(row.get("seconds") or 0.0) or None) if row else None

    def _logged_rows(self, stage: Stage):
        """The stage's rows in the logged builds of this model and target, newest first."""
        for entry in reversed(self.store.build_log(last=50)):
            if (entry.get("model"), entry.get("target")) == (self.config.model, self.config.target):
                yield from (row for row in entry.get("stages", [])
                            if (row.get("stage"), row.get("method")) == (stage.kind, stage.method))

    def log_path(self, stage: Stage) -> Path:
        return self.config.build_dir / "logs" / f"{stage.id}.log"

    def _output_of(self, stage: Stage):
        """Where the stage's third-party output goes while it runs: its log, or the console."""
        if not self.capture_output:
            return contextlib.nullcontext()
        self.logs[stage.id] = self.log_path(stage)
        return terminal.capture(self.logs[stage.id])

    # -- execution -----------------------------------------------------------------------------

    def execute(self, stage: Stage) -> str:
        """Bring one stage up to date; returns ran, cached, restored or remote."""
        self._record_startup()
        with self.recorder.span(stage.id, "stage", step="execute") as span:
            span["status"] = status = self._execute(stage, span)
        return status

    def _execute(self, stage: Stage, span: dict) -> str:
        decision = self.decide(stage, find=self.store.find_record)
        key, inputs, old = decision.key, decision.inputs, decision.old
        span["key"] = key
        if decision.verdict == "cached":
            return self._note(stage, "cached")
        if decision.verdict == "restorable":
            status = self._restore(stage, key, inputs, decision.record, decision.tier)
            if status:
                return self._note(stage, status)
        if self.delegate is not None:
            return self._note(stage, self._delegated(stage, decision))
        if self.warm is not None:
            status = self._run_warm(stage, span)
            if status:
                return self._note(stage, status)
        with self._key_lock(key):
            # Another process may have built this key while we waited for the lock, and another
            # machine may be building it now.
            status, lease = self._claim(stage, key, inputs)
            if status:
                return self._note(stage, status)
            why = explain_reason(old.inputs if old else None, inputs, self.pipeline)
            with lease:
                self._run(stage, key, inputs, why)
        return self._note(stage, "ran")

    def execute_here(self, stage: Stage) -> str:
        """execute() without a stage span of its own: for a process that runs a stage for another,
        whose span covers it (cudabuild.warm_stage)."""
        with self.recorder.active():
            return self._execute(stage, {})

    def _run_warm(self, stage: Stage, span: dict) -> Optional[str]:
        """Run the stage in the warm process (its server's pid goes in the stage's span); its
        status, or None when the stage is to run here: none answers and this build starts none
        (later stages ask again), or none could serve (later ones of this process run here too)."""
        from cudabuild.engine.warm import WarmNotRunning, WarmUnavailable

        asked = trace.now_us()
        try:
            outcome = self.warm(stage)
        except WarmNotRunning:  # none up, and this build does not start one: run here, no warning
            return None
        except WarmUnavailable as e:
            # The time spent waiting for one that did not come is named (a served call's own wait
            # is recorded by the process that took it, from when it was asked: warm_stage).
            self.recorder.complete(WAITS["warm"], asked, trace.now_us(), "wait", served=False)
            terminal.warn(f"{e}; stages run in the build's own processes")
            self.warm = None
            return None
        self.logs[stage.id] = self.log_path(stage)
        span["warm"] = outcome.get("server")
        self.recorder.adopt(outcome.get("events") or [])
        if outcome.get("error") is not None:
            raise outcome["error"]
        return outcome["status"]

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
            record, tier = self.store.find_record(key)
            if record is not None and (status := self._restore(stage, key, inputs, record, tier)):
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
            with trace.wait(WAITS["lease"], key=key[:12]):
                remote.wait_for_result(key, deadline)

    def _delegated(self, stage: Stage, decision: Decision) -> str:
        """Have the delegate run the stage (on a cluster's worker), then restore the record it
        published to the shared tier: `ran` when that worker built it, `remote` when it found it
        built already. Its stamp says where it ran, for how long, and why."""
        key, inputs = decision.key, decision.inputs
        upstream = {}
        for dependency in self.pipeline.dependencies(stage, self.config):
            stamp = self.require_stamp(dependency)
            upstream[dependency.id] = dataclasses.asdict(stamp)
        work = {"stage": [stage.kind, stage.method], "key": key, "inputs": inputs, "upstream": upstream,
                "fingerprint": self.fingerprint(), "run": self.run_id}
        label = f"{self.config.model}/{self.config.target}:{stage.id}"
        outcome = self.delegate(label, work, self.resources(stage, inputs))
        worker = outcome.get("worker") or {}
        on = f"{worker.get('host')}:{worker.get('pid')}"
        if outcome.get("events"):
            gpu = f", GPU {worker['gpu']}" if worker.get("gpu") not in (None, "") else ""
            self.recorder.add_process(outcome["events"], f"worker {worker.get('name')} ({on}{gpu})",
                                      str(worker.get("host")), int(worker.get("pid") or 0))
        if outcome.get("status") == "failed":
            raise CudabuildError(f"on worker {worker.get('name')} ({on}): {outcome['error']}")
        record, tier = self.store.find_record(key)
        where = self.store.remote.where if self.store.remote is not None else "none"
        if record is None or not self._restore(stage, key, inputs, record, tier):
            raise CudabuildError(f"stage {stage.id} {outcome.get('status')} on worker {worker.get('name')} ({on}), "
                                 f"but its record {key[:12]} is not in the shared tier {where}: start the workers "
                                 "with the driver's CUDABUILD_REMOTE")
        status = "ran" if outcome.get("status") == "ran" else "remote"
        restored = self.require_stamp(stage)
        self._write_stamp(stage, restored.replace(
            status=status, seconds=float(outcome.get("seconds") or 0.0) if status == "ran" else 0.0,
            reason=outcome.get("reason") if status == "ran" else None,
            peak_rss=outcome.get("peak_rss") if status == "ran" else None,
            saved_seconds=None if status == "ran" else restored.saved_seconds, worker=worker or None))
        return status

    def resources(self, stage: Stage, inputs: dict) -> dict[str, float]:
        """What the stage asks of a cluster's worker: one of its row's device, and its memory estimate."""
        row = self.pipeline.row(stage)
        device = row.device(self.config, stage.method) if row.device else None
        return cluster.resources_for(device, self.memory_estimate(stage, inputs))

    def _note(self, stage: Stage, status: str) -> str:
        self.statuses[stage.id] = status
        return status

    def _restore(self, stage: Stage, key: str, inputs: dict, record: dict, source: str) -> Optional[str]:
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
        self._write_stamp(stage, Stamp(
            key=key, inputs=inputs, digest=record["digest"], outputs=record["outputs"], finals=finals,
            value=record.get("value"), status=status, seconds=0.0, saved_seconds=record.get("seconds", 0.0),
            run=self.run_id,
        ))
        return status

    def _run(self, stage: Stage, key: str, inputs: dict, why: str) -> None:
        with tempfile.TemporaryDirectory(prefix=f"cudabuild-{stage.id}-") as tmp:
            ctx = StageContext(self.config, stage, inputs, key, Path(tmp), self, self.log)
            with self._output_of(stage):
                # The stage's module, and what it imports at its top, loads before the stage waits
                # for its turn (a worker's wait is spent importing), and prints into its log.
                with trace.phase("import", min_seconds=0.05):
                    module = importlib.import_module(self.pipeline.row(stage).module)
                with self._admitted(stage, inputs):
                    start = time.monotonic()
                    with trace.phase("run"), memory.PeakSampler() as sampled:
                        result: StageResult = module.run(ctx)
                    # What the stage left behind is collected now, before the next stage (here, or
                    # let in beside) adds its own: after a stage that held much more than it started
                    # with (where /proc cannot say, always).
                    memory.collect_if_worth(sampled.grown())
            with trace.phase("store writes"):
                outputs = {name: self.store.put_file(path, result.known.get(name)) for name, path in sorted(result.files.items())}
                outputs.update(self._stored(stage, result.stored))
            seconds = round(time.monotonic() - start, 3)
            stage_digest = result.digest or digest(outputs)
            finals = sorted(result.files) if self.pipeline.final_outputs(stage) else []
            record = {"stage": stage.id, "digest": stage_digest, "outputs": outputs, "finals": finals,
                      "value": result.value, "seconds": seconds}
            for name in finals:
                atomic_copy(result.files[name], self.config.build_dir / name)
                self.store.hasher.remember(self.config.build_dir / name, outputs[name])
        self.store.put_record(key, record)
        self._write_stamp(stage, Stamp(
            key=key, inputs=inputs, digest=stage_digest, outputs=outputs, finals=finals, value=result.value,
            status="ran", seconds=seconds, run=self.run_id, reason=why, peak_rss=sampled.peak,
        ))
        if self.store.remote is not None:
            with trace.phase("upload"):
                self.store.push(key, record)  # write-back to the shared tier: blobs, then the record
        cache_admin.enforce_limit(self.store, self.config.project)

    @contextlib.contextmanager
    def _admitted(self, stage: Stage, inputs: dict):
        """Run beside the build's other stages when they fit in memory together, else alone; and
        with the stage's device to itself (cudabuild.engine.workers). The memory lock is always
        taken first, so no two stages can wait on each other. One stage at a time takes none."""
        if self.workers <= 1:
            yield
            return
        row = self.pipeline.row(stage)
        alone_because = row.runs_alone(self.config, stage.method) if row.runs_alone else None
        device = row.device(self.config, stage.method) if row.device else None
        estimate = self.memory_estimate(stage, inputs) if not alone_because else None
        admission = workers.admission(self.workers, estimate, alone_because, workers.available_memory())
        locks = self.store.root / "locks"
        on_device = workers.device_admission(self.workers, self._last_device_peak(stage),
                                             workers.free_device_memory(device),
                                             from_inputs=self._upstream_bytes(stage)) if device else None
        with trace.phase("admitted", alone=admission.alone, why=admission.why, device=device or "",
                         device_alone=bool(on_device and on_device.alone),
                         device_why=on_device.why if on_device else ""), \
                contextlib.ExitStack() as held:
            with trace.wait(WAITS["memory"], alone=admission.alone):
                waited = held.enter_context(workers.admitted(locks / "stages", admission.alone))
            if device:
                with trace.wait(WAITS["device"], device=device, alone=on_device.alone):
                    waited += held.enter_context(workers.admitted(workers.device_lock(locks, device), on_device.alone))
            if waited >= 1.0:
                self.log(f"{stage.id}: waited {waited:.0f}s for its turn "
                         f"({admission.why}{f'; on {device}: {on_device.why}' if device else ''})")
            yield

    def memory_estimate(self, stage: Stage, inputs: dict) -> Optional[int]:
        """What the stage will hold at its peak, in bytes, or None when nothing says: the larger of
        its inputs' bytes (upstream outputs, and the checkpoint when the stage is keyed on it) scaled
        by workers.INPUT_FACTOR (upstream outputs only where its row says memory_from_upstream), and
        the peak its last run measured."""
        read = self._upstream_bytes(stage) if self.pipeline.row(stage).memory_from_upstream else 0
        if inputs.get("checkpoint") and self.config.checkpoint:
            read += sum(f.stat().st_size for f in self.config.checkpoint.rglob("*") if f.is_file())
        from_inputs = int(read * workers.INPUT_FACTOR) + workers.PROCESS_BYTES if read else None
        last = self._last_peak(stage)
        from_history = int(last * workers.HISTORY_MARGIN) if last else None
        known = [b for b in (from_inputs, from_history) if b is not None]
        return max(known) if known else None

    def _upstream_bytes(self, stage: Stage) -> int:
        """The bytes of what the stages it depends on handed it (the program and its weights)."""
        shas = set()
        for upstream in self.pipeline.dependencies(stage, self.config):
            stamp = self.read_stamp(upstream)
            if stamp is not None:
                shas.update(stamp.outputs.values())
        return self.store.blob_bytes(shas)

    def _last_peak(self, stage: Stage) -> Optional[int]:
        """The resident peak of the stage's last run: its stamp's, else that of the same stage of
        another method (the methods of one model hold the same weights: in a first build, the
        method exported first sizes the next), else the newest logged build of this model and
        target that ran it."""
        for candidate in self._and_siblings(stage):
            stamp = self.read_stamp(candidate)
            if stamp is not None and stamp.status == "ran" and stamp.peak_rss:
                return int(stamp.peak_rss)
        return next((int(row["peak_rss"]) for row in self._logged_rows(stage) if row.get("peak_rss")), None)

    def _last_device_peak(self, stage: Stage) -> Optional[int]:
        """The device bytes the stage allocated at most in its last run (its value's
        peak_gpu_bytes), else those of the same stage of another method."""
        for candidate in self._and_siblings(stage):
            stamp = self.read_stamp(candidate)
            peak = stamp.value.get("peak_gpu_bytes") if stamp is not None and isinstance(stamp.value, dict) else None
            if peak:
                return int(peak)
        return None

    def _and_siblings(self, stage: Stage) -> list[Stage]:
        """The stage, then the same stage of the model's other methods (which hold the same weights)."""
        return [stage] + [Stage(stage.kind, m) for m in self.config.methods if stage.method and m != stage.method]

    def _stored(self, stage: Stage, stored: dict[str, str]) -> dict[str, str]:
        missing = sorted(name for name, sha in stored.items() if not self.store.has_blob(sha))
        if missing:
            raise CudabuildError(f"stage {stage.id} handed on {missing[0]}, which is no longer in the cache")
        return dict(stored)

    @contextlib.contextmanager
    def _key_lock(self, key: str):
        lock_dir = self.store.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / key[:16], "a+") as handle:
            with trace.wait(WAITS["key"], key=key[:12]):
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

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
        with self._key_lock(key):
            self._run(stage, key, inputs, "a cached output was missing or corrupt")
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

    # -- manifest ------------------------------------------------------------------------------

    def manifest(self) -> dict:
        stages = []
        outputs = {}
        verify = {}
        for stage in self.pipeline.plan(self.config):
            stamp = self.read_stamp(stage)
            this_run = stamp is not None and stamp.run == self.run_id
            # What this process did, not what the stamp says now: another build of the same project
            # may have rewritten the stamp since (its restore of what we ran), which made a stage
            # this build compiled read as "cached" and the other's "restored": no "ran" at all.
            # Under `doit -n` stages run in worker processes: their statuses reach us only through
            # the stamps they wrote with this run's id.
            status = self.statuses.get(stage.id) or (stamp.status if this_run else None) or "cached"
            entry = {"stage": stage.kind, "method": stage.method, "key": stamp.key if stamp else None,
                     "status": status, "seconds": stamp.seconds if this_run else 0.0}
            if this_run and stamp.reason:
                entry["reason"] = stamp.reason
            if this_run and stamp.peak_rss:
                entry["peak_rss"] = stamp.peak_rss  # bytes resident at the stage's peak (sampled)
            if this_run and stamp.worker:
                entry["worker"] = stamp.worker  # the cluster's worker it ran on (cudabuild.engine.cluster)
            if this_run and isinstance(stamp.value, dict) and stamp.value.get("note"):
                entry["note"] = stamp.value["note"]  # what the stage says it did (the blob stage: rewritten)
            if status in ("restored", "remote", "cached"):
                entry["saved_seconds"] = stamp.cost_seconds if stamp else 0.0
            stages.append(entry)
            if stamp is None:
                continue
            for name in stamp.finals:
                outputs[name] = stamp.outputs[name]
            if stage.kind == "verify" and stamp.value:  # the manifest's verify section: each method's numbers
                verify[stage.method] = stamp.value
        probe = self.read_stamp(Stage("probe"))
        return {"model": self.config.model, "target": self.config.target, "options": dict(self.config.options),
                "specs": {m: dict(s) for m, s in self.config.specs.items()}, "toolchain": probe.value if probe else None,
                "stages": stages, "outputs": dict(sorted(outputs.items())), "verify": verify}

    def rekey(self, stage: Stage) -> bool:
        """Point a built stage's stamp, and a record, at its current key without running it.

        For a change of inputs known not to change what the stage produces (autotune=pin names the
        decisions the compile just made, and replaying them reproduces it). False if already so.
        """
        stamp = self.require_stamp(stage)
        inputs = self.inputs(stage)
        key = digest(inputs)
        if key == stamp.key:
            return False
        self.store.put_record(key, {"stage": stage.id, "digest": stamp.digest, "outputs": stamp.outputs,
                                    "finals": stamp.finals, "value": stamp.value, "seconds": stamp.seconds})
        self._write_stamp(stage, stamp.replace(key=key, inputs=inputs))
        return True

    def write_manifest(self) -> dict:
        """After every stage succeeded: manifest.json, the build log, and no stale failure reports."""
        manifest = self.manifest()
        atomic_write_text(self.config.build_dir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=False))
        for method in manifest["verify"]:  # each verified now: an earlier failure's report is history
            (self.config.build_dir / f"verify-{method}.failed.json").unlink(missing_ok=True)
        self.store.record_build(manifest)
        return manifest

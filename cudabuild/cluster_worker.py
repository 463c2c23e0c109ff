"""What a Dask worker does with one stage of a nightly sent to a cluster (cudabuild.engine.cluster).

`run_stage(payload)` is the task: it configures the same build as the driver did (its project, at
$CUDABUILD_PROJECT on the worker when that is set, else the driver's path; the same settings),
in a workspace of its own in the worker's local directory: its cache, and a build/ that only this
worker writes. The driver's stamps of the stage's upstream stages are placed there, the stage's key
is computed again and must be the driver's (WorkerMismatch says what differs), and the stage's Job
is built and run there (cudabuild.engine.far_end: no Runner): under the tier's lease, and written
back to it, blobs first, then the record; a record the tier has by now is taken as it is. The
outcome (status, seconds, peak memory, where it ran, the trace's spans) goes back to the driver,
whose runner restores the record and stamps it.

A stage that fails comes back as an outcome with its one-line error and its log's last lines; it
is not retried (it would fail again). One whose upstream blob was bad here comes back as "lost",
naming the producer: the driver's runner rewinds it and sends the stage again. A worker that dies
is the scheduler's to retry.

Owns a worker's workspace, its check of the toolchain and the key, and the outcome it reports.
Must not touch: a Runner (it builds none), the decision, the driver's stamps.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cudabuild.backend.toolchain import fingerprint_difference
from cudabuild.config import load_config
from cudabuild.engine import cache_admin, cluster, far_end, frames, room
from cudabuild.engine.console import trace
from cudabuild.engine.console.progress import failure_lines
from cudabuild.engine.executors import Job
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.engine.graph import Stage
from cudabuild.engine.hashing import digest
from cudabuild.engine.stage_io import LostInput
from cudabuild.engine.stamp import Stamp
from cudabuild.engine.store import Store
from cudabuild.errors import ClusterError, CudabuildError, WorkerMismatch, one_line

_STORES: dict[Path, Store] = {}  # one open cache per workspace, for the worker process's life
_STORES_LOCK = threading.Lock()


def _store(workspace: Path, tier: str) -> Store:
    with _STORES_LOCK:
        if workspace not in _STORES:
            _STORES[workspace] = Store(workspace / "cache")
        store = _STORES[workspace]
    if store.remote is None or store.remote.where != tier:
        mine = f"is {store.remote.where}" if store.remote is not None else "is not set"
        raise ClusterError(f"this worker's shared tier {mine}, its driver's is {tier}: start the worker with the "
                           "driver's CUDABUILD_REMOTE, or the driver cannot restore what it builds")
    return store


def run_stage(payload: dict) -> dict:
    """Run one stage the driver decided must run; returns its outcome (see the module's docstring)."""
    with cluster.on_worker(payload["task"], payload["run"]) as (where, workspace):
        job = recorder = None
        try:
            job = _prepared(payload, workspace)
            recorder = trace.Recorder(job.build.config.build_dir, payload["run"])
            done = _run(job, recorder)
        except LostInput as e:
            return {"status": "lost", "producer": [e.kind, e.method], "error": str(e), "worker": where,
                    "events": recorder.take_own() if recorder is not None else []}
        except CudabuildError as e:
            return {"status": "failed", "error": one_line(e) + failure_lines(job.log if job is not None else None, error=e),
                    "worker": where, "events": recorder.take_own() if recorder is not None else []}
        # This worker's cache under its size limit ($CUDABUILD_CACHE_MAX_SIZE): its build is this stage.
        cache_admin.enforce_limit(job.build.store, job.build.config.project)
        return {"status": done["status"] or "remote", "seconds": done.get("seconds", 0.0), "peak_rss": done.get("peak_rss"),
                "worker": where, "events": recorder.take_own(), "run": payload["run"]}


def _run(job: Job, recorder: trace.Recorder) -> dict:
    """The job run here (far_end.run, its write-back required: the driver restores it from the tier),
    in the stage span and with the full disk's one line a build's own process gives it."""
    build_dir = job.build.config.build_dir
    with room.named(job.stage.id, job.build.store.root, build_dir), \
            recorder.span(job.stage.id, "stage", step="execute") as span:
        span["key"] = job.key
        done = frames.on_fresh_chunk(far_end.run, job, True)  # frames laid out as in a build's own process
        span["status"] = done["status"] or "remote"
    return done


def _prepared(payload: dict, workspace: Path) -> Job:
    """The stage's Job on this worker, once its toolchain and its key are found to be the driver's."""
    store = _store(workspace, payload["tier"])
    build = payload["build"]
    project = Path(os.environ.get("CUDABUILD_PROJECT") or build["project"]).resolve()
    config = load_config(project, build["settings"], store, build_root=workspace / "build")
    stage = Stage(*payload["stage"])
    # The probe is keyed on the driver's toolchain fingerprint, so a worker's machine-local facts
    # (its GPU's bus address, its compiler's inode) do not make its keys differ; what decides a
    # build (package versions, the inductor environment) must agree.
    ours = config.pipeline.cheap_fingerprint(config.target)
    if differs := fingerprint_difference(ours, payload["fingerprint"]):
        raise WorkerMismatch(stage.id, f"this worker's toolchain is not its driver's ({differs})",
                             "packages and environment")
    job = far_end.job(config, store, stage, payload["key"], payload["inputs"], run_id=payload["run"],
                      fingerprint=payload["fingerprint"])
    for stage_id, data in payload["upstream"].items():
        stamp = Stamp.from_json(data)
        if stamp is not None:
            job.io.stamps.write(Stage.parse(stage_id), stamp)
    inputs = far_end.key_inputs(config, store, stage, payload["fingerprint"], job.io.stamps)
    if (key := digest(inputs)) != payload["key"]:
        why = explain_reason(payload["inputs"], inputs, config.pipeline)
        raise WorkerMismatch(stage.id, f"this worker keys it {key[:12]}, its driver {payload['key'][:12]} ({why})",
                             "project, settings and checkpoint")
    return job

"""What a Dask worker does with one stage of a nightly sent to a cluster (cudabuild.engine.cluster).

`run_stage(payload)` is the task: it configures the same build as the driver did (its project, at
$CUDABUILD_PROJECT on the worker when that is set, else the driver's path; the same settings),
in a workspace of its own in the worker's local directory: its cache, and a build/ that only this
worker writes. The driver's stamps of the stage's upstream stages are placed there, the stage's key
is computed again and must be the driver's (WorkerMismatch says what differs), and Runner.execute
brings it up to date: restored when the shared tier has it by now, else built under the tier's
lease and written back to it, blobs first, then the record. The outcome (status, seconds, why,
peak memory, where it ran, the trace's spans) goes back to the driver, which restores the record.

A stage that fails comes back as an outcome with its one-line error and its log's last lines; it
is not retried (it would fail again). A worker that dies is the scheduler's to retry.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cudabuild.backend.toolchain import fingerprint_difference
from cudabuild.config import load_config
from cudabuild.engine import cache_admin, cluster, frames
from cudabuild.engine.console.progress import failure_lines
from cudabuild.engine.explain import reason as explain_reason
from cudabuild.engine.graph import Stage
from cudabuild.engine.runner import Runner
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
        runner = None
        try:
            runner, stage = _runner(payload, workspace)
            status = frames.on_fresh_chunk(runner.execute, stage)  # frames laid out as in a build's own process
        except CudabuildError as e:
            log = runner.logs.get(Stage(*payload["stage"]).id) if runner is not None else None
            return {"status": "failed", "error": one_line(e) + failure_lines(log), "worker": where,
                    "events": runner.recorder.take_own() if runner is not None else []}
        # This worker's cache under its size limit ($CUDABUILD_CACHE_MAX_SIZE): its build is this stage.
        cache_admin.enforce_limit(runner.store, runner.config.project)
        stamp = runner.read_stamp(stage)
        return {"status": status, "seconds": stamp.seconds, "reason": stamp.reason, "peak_rss": stamp.peak_rss,
                "worker": where, "events": runner.recorder.take_own(), "run": payload["run"]}


def _runner(payload: dict, workspace: Path) -> tuple[Runner, Stage]:
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
    runner = Runner(config, store, payload["run"], capture_output=True, workers=1, publish_required=True,
                    _fingerprint=payload["fingerprint"], _startup_recorded=True)
    for stage_id, data in payload["upstream"].items():
        stamp = Stamp.from_json(data)
        if stamp is not None:
            stamp.save(runner.stamps.path(_stage_of(stage_id)))
    decision = runner.decide(stage)
    if decision.key != payload["key"]:
        why = explain_reason(payload["inputs"], decision.inputs, config.pipeline)
        raise WorkerMismatch(stage.id, f"this worker keys it {decision.key[:12]}, its driver {payload['key'][:12]} ({why})",
                             "project, settings and checkpoint")
    return runner, stage


def _stage_of(stage_id: str) -> Stage:
    kind, _, method = stage_id.partition(".")
    return Stage(kind, method or None)

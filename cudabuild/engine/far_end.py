"""The far end of an executor that hands a stage to another process: the warm process's child
(cudabuild.warm_stage, for executors.WarmProcess) and a cluster's worker (cudabuild.cluster_worker,
for executors.ClusterWorker).

Each builds the stage's Job here from what it was sent and the cache it has (`job`: the stage's
I/O, what its admission reads), runs it as InProcess runs any (the key's lock, the key's lease on
the shared tier, its admission, a work folder, its log), and keeps what it made: into the action
cache, then written back to the shared tier (`run`), as Bazel's remote execution stores an
action's result. The runner that handed the stage over settles it: restores the record and
writes its stamp.

No Runner is built here. Nothing is decided (the runner that handed the stage over decided it must
run; a record that appears while the key's lock or lease is awaited is reported, not run), nothing
is stamped, and nothing is rewound: the I/O built here has no `rewind`, so a bad upstream blob
raises LostInput back to that runner, which brings the producer up to date and runs the stage
again.

Owns building a handed-over stage's Job and what its run reports back. Must not touch: the
decision, stamps, rewinding (runner.py), how the stage runs (executors.py).
"""

from __future__ import annotations

from typing import Optional

from cudabuild.engine.admission import BuildView
from cudabuild.engine.executors import InProcess, Job, Published, log_path
from cudabuild.engine.graph import Build, Stage
from cudabuild.engine.stage_io import StageIO
from cudabuild.engine.stamp import Stamps


def job(config: Build, store, stage: Stage, key: str, inputs: dict, *, run_id: str, fingerprint: dict,
        workers: int = 1, capture_output: bool = True, label: str = "") -> Job:
    """The stage's Job in this process, on `store` (a cudabuild.engine.store.Store) and the stamps
    under config.build_dir; its third-party output in its log there when `capture_output`."""
    stamps = Stamps.of(config)
    io = StageIO(stage, tuple(config.pipeline.dependencies(stage, config)), stamps, store.objects, store.actions)
    return Job(stage, key, inputs, io, BuildView(config, stamps, store, workers), config.pipeline.row(stage).module,
               log=log_path(config.build_dir, stage) if capture_output else None, label=label,
               fingerprint=fingerprint, run_id=run_id)


def run(job: Job, publish_required: bool = False) -> dict:
    """Run the job here and keep what it made (ActionCache.store, then write_back: required, where
    the runner that handed it over restores it from the shared tier). What it did, for that runner:
    status "ran" with its seconds and measures, or "" when another builder's record appeared and
    nothing ran here."""
    with InProcess().run(job) as outcome:
        if isinstance(outcome, Published):
            return {"status": ""}
        actions = job.io.actions
        record = actions.store(job.key, job.stage.id, outcome.result, job.build.pipeline.final_outputs(job.stage),
                               job.build.config.build_dir, outcome.started, job.io.handed_on)
        actions.write_back(job.stage.id, job.key, record, publish_required)
    return {"status": "ran", "seconds": record["seconds"], "peak_rss": outcome.peak_rss,
            "written_bytes": outcome.written_bytes, "peak_private": outcome.peak_private}


def key_inputs(config: Build, store, stage: Stage, fingerprint: dict, stamps: Optional[Stamps] = None) -> dict:
    """The stage's key inputs as this process computes them, on its stamps of the upstream stages
    and the toolchain fingerprint it was handed (a cluster's worker checks its key is the driver's)."""
    stamps = stamps or Stamps.of(config)
    return config.pipeline.inputs(stage, config, stamps.result, lambda: fingerprint,
                                  lambda folder=None, layout=False: config.pipeline.checkpoint_digest(
                                      config, store.hasher, folder, layout))


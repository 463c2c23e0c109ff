"""A stage that must run, run in the cache's warm process (cudabuild.engine.warm): a fork or a spare.

`WarmStages(runner, settings)` is what the build's executor (cudabuild.engine.executors.WarmProcess)
calls for one build. It hands the warm process what configures the same build (the project and
the command line's settings) and the Job the runner decided must run: its stage, key and inputs,
the run id, toolchain fingerprint and worker count. `run_stage` runs in the process that serves the
call: it loads the build's configuration from the project on disk (the child's cudabuild and
recipes are read fresh), builds the stage's Job on the same cache and build/ (cudabuild.engine.far_end:
its I/O, what its admission reads; no Runner), and runs it as the caller would have: key lock,
lease, admission, run, then its outputs and record stored in the cache. The caller's runner then
settles it: restores the record (its final outputs are in build/ already) and writes the stamp.
What goes back is what the run did (the status, its seconds and measures) and the child's timeline
events (the caller adopts them as its own: among them the wait from the caller's asking to the
child's taking the call, and the child's reading of the configuration), or the CudabuildError that
stopped it, which the caller raises as its own (LostInput: an upstream blob was bad, and the
caller's runner rewinds its producer).

Owns the payload of that call and its answer. Must not touch: a Runner (it builds none), the
decision, stamps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from cudabuild.engine import frames
from cudabuild.engine.console import trace
from cudabuild.engine.graph import Stage
from cudabuild.engine.admission import WAITS
from cudabuild.engine.runner import Runner
from cudabuild.engine.warm import WarmProcesses

FUNCTION = "cudabuild.warm_stage:run_stage"


class WarmStages:
    """The call of one build's WarmProcess executor: runs a stage in the cache's warm
    process. Made when the build starts, so the process's key is of the build's environment and
    sys.path before any stage could change them."""

    def __init__(self, runner: Runner, settings: Mapping[str, str]):
        self.runner, self.settings = runner, dict(settings)
        self.processes = WarmProcesses(runner.store.root, runner.pipeline.warm_imports(runner.config.target))
        # Several workers would each import torch: one warm process, started now if need be,
        # imports it once for all. A build of one worker imports it once anyway, and its later
        # stages then keep inductor's in-memory state, which a fork of the server starts without
        # (measured on 2 cores, tiny_lm cold with one worker: 38.0 s through a server the build
        # started, 35.3 s without one). It uses a server only if one answers already, and
        # after_build starts one for the next build.
        self.start = runner.workers > 1

    def __call__(self, job) -> dict:
        """Run `job` (an executors.Job) in the warm process; what it did there (run_stage's answer)."""
        runner = self.runner
        payload = {"project": str(runner.config.project), "settings": self.settings,
                   "stage": [job.stage.kind, job.stage.method], "key": job.key, "inputs": job.inputs, "run": job.run_id,
                   "fingerprint": job.fingerprint, "workers": runner.workers, "capture_output": job.log is not None,
                   "cache": str(runner.store.root), "asked_us": trace.now_us()}
        outcome = self.processes.call(FUNCTION, payload, start=self.start)
        outcome["server"] = self.processes.last_server
        return outcome

    def after_build(self, statuses: list[str]) -> bool:
        """Once a build that ran stages is done, start the warm process in the background for the
        next build (an edit's or a spec change's stage then imports nothing), unless one answers
        already. Detached: this build's exit does not wait for its imports."""
        return "ran" in statuses and self.processes.start_in_background()


def run_stage(payload: dict) -> dict:
    from cudabuild.config import load_config
    from cudabuild.engine import far_end
    from cudabuild.engine.store import Store
    from cudabuild.engine.warm_server import picklable
    from cudabuild.errors import CudabuildError

    taken = trace.now_us()
    store = Store(payload["cache"])
    recorder = None
    try:
        config = load_config(Path(payload["project"]), payload["settings"], store)
        recorder = trace.Recorder(config.build_dir, payload["run"])
        # From the caller's asking to this process's taking the call: the server starting, or a
        # spare or a fork coming free. Then the build's configuration, read again here.
        if payload.get("asked_us"):
            recorder.complete(WAITS["warm"], payload["asked_us"], taken, "wait", served=True)
        recorder.complete("configure", taken, trace.now_us())
        job = far_end.job(config, store, Stage(*payload["stage"]), payload["key"], payload["inputs"],
                          run_id=payload["run"], fingerprint=payload["fingerprint"], workers=payload["workers"],
                          capture_output=payload["capture_output"])
        with recorder.active():
            done = frames.on_fresh_chunk(far_end.run, job)  # as a build's own process lays them out
    except CudabuildError as e:
        # The error, or one with its message where its class cannot be rebuilt from its args.
        return {"error": picklable(e, CudabuildError(str(e))), "events": recorder.take_own() if recorder is not None else []}
    return dict(done, events=recorder.take_own())

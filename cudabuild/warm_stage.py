"""A stage that must run, run in the cache's warm process (cudabuild.engine.warm): a fork or a spare.

`WarmStages(runner, settings)` is what the build's executor (cudabuild.engine.executors.WarmProcess)
calls for one build. It hands the warm
process what configures the same build (the project and the command line's settings) and names
the stage; `run_stage` runs in the process that serves the call: it loads the build's configuration from the
project on disk (the child's cudabuild and recipes are read fresh), makes a Runner on the same
cache and build/ with the caller's run id, toolchain fingerprint and worker count, and brings the
stage up to date exactly as the caller would have: key lock, lease, admission, run, store, stamp.
What goes back is the status and the child's timeline events (the caller adopts them as its
own: among them the wait from the caller's asking to the child's taking the call, and the child's
reading of the configuration), or the CudabuildError that stopped it, which the caller raises as
its own.
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

    def __call__(self, stage: Stage) -> dict:
        runner = self.runner
        payload = {"project": str(runner.config.project), "settings": self.settings,
                   "stage": [stage.kind, stage.method], "run": runner.run_id, "fingerprint": runner.fingerprint(),
                   "workers": runner.workers, "capture_output": runner.capture_output, "cache": str(runner.store.root),
                   "asked_us": trace.now_us()}
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
    from cudabuild.engine.store import Store
    from cudabuild.engine.warm_server import picklable
    from cudabuild.errors import CudabuildError

    taken = trace.now_us()
    store = Store(payload["cache"])
    runner = None
    try:
        config = load_config(Path(payload["project"]), payload["settings"], store)
        runner = Runner(config, store, payload["run"], capture_output=payload["capture_output"],
                        workers=payload["workers"], _fingerprint=payload["fingerprint"], _startup_recorded=True)
        # From the caller's asking to this process's taking the call: the server starting, or a
        # spare or a fork coming free. Then the build's configuration, read again here.
        if payload.get("asked_us"):
            runner.recorder.complete(WAITS["warm"], payload["asked_us"], taken, "wait", served=True)
        runner.recorder.complete("configure", taken, trace.now_us())
        status = frames.on_fresh_chunk(runner.execute_here, Stage(*payload["stage"]))  # as a build's own process lays them out
    except CudabuildError as e:
        # The error, or one with its message where its class cannot be rebuilt from its args.
        return {"error": picklable(e, CudabuildError(str(e))),
                "events": runner.recorder.take_own() if runner is not None else []}
    return {"status": status, "events": runner.recorder.take_own()}

"""A stage that must run, run in a fork of the cache's warm process (cudabuild.engine.warm).

`for_build(runner, settings)` is the Runner's `warm` function for one build. It hands the warm
process what configures the same build (the project and the command line's settings) and names
the stage; `run_stage` runs in the forked child: it loads the build's configuration from the
project on disk (the child's cudabuild and recipes are read fresh), makes a Runner on the same
cache and build/ with the caller's run id, toolchain fingerprint and worker count, and brings the
stage up to date exactly as the caller would have: key lock, lease, admission, run, store, stamp.
What goes back is the status and the child's timeline events (the caller adopts them as its
own), or the CudabuildError that stopped it, which the caller raises as its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from cudabuild.engine.graph import Stage
from cudabuild.engine.runner import Runner
from cudabuild.engine.warm import WarmProcesses

FUNCTION = "cudabuild.warm_stage:run_stage"


def for_build(runner: Runner, settings: Mapping[str, str]) -> Callable[[Stage], dict]:
    processes = WarmProcesses(runner.store.root, runner.pipeline.warm_imports(runner.config.target))

    def run(stage: Stage) -> dict:
        payload = {"project": str(runner.config.project), "settings": dict(settings),
                   "stage": [stage.kind, stage.method], "run": runner.run_id, "fingerprint": runner.fingerprint(),
                   "workers": runner.workers, "capture_output": runner.capture_output, "cache": str(runner.store.root)}
        return processes.call(FUNCTION, payload)

    return run


def run_stage(payload: dict) -> dict:
    import os

    from cudabuild.config import load_config
    from cudabuild.engine.store import Store
    from cudabuild.errors import CudabuildError

    store = Store(payload["cache"])
    runner = None
    try:
        config = load_config(Path(payload["project"]), payload["settings"], store)
        runner = Runner(config, store, payload["run"], capture_output=payload["capture_output"],
                        workers=payload["workers"], _fingerprint=payload["fingerprint"], _startup_recorded=True)
        status = runner.execute_here(Stage(*payload["stage"]))
    except CudabuildError as e:
        return {"error": _picklable(e), "events": runner.recorder.take_own() if runner is not None else [],
                "server": os.getppid()}
    return {"status": status, "events": runner.recorder.take_own(), "server": os.getppid()}


def _picklable(error):
    """The error, or one with its message where its class cannot be rebuilt from its args."""
    import pickle

    from cudabuild.errors import CudabuildError

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return CudabuildError(str(error))

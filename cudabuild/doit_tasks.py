"""The stage graph as doit tasks. dodo.py only re-exports what is here.

Each stage is a sub-task of `export` (`export:compile.decode`, ...), ordered by `task_dep`. Its
`uptodate` check asks the runner whether the stamp in build/ holds the current action key, and
its action brings the stage up to date (cached / restored / ran). doit's own database only
remembers what the store already knows: deleting `.doit.db` loses nothing. A last sub-task,
`export:manifest`, always runs: it writes build/<model>/<target>/manifest.json and prints the
summary. Bad input stops the load with one line and exit status 2, before anything runs.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

from doit.exceptions import TaskFailed

from .config import load_config
from .errors import CudabuildError, one_line
from .graph import dependencies, plan
from .reporter import CudabuildReporter, print_summary
from .runner import Runner
from .store import Store

RUN_ID = uuid.uuid4().hex
STARTED = time.monotonic()


def cli_vars() -> dict[str, str]:
    from doit import doit_cmd

    return dict(doit_cmd._CMDLINE_VARS or {})


def project_root() -> Path:
    return Path(os.environ.get("CUDABUILD_PROJECT") or os.getcwd()).resolve()


def fail_fast(error: CudabuildError) -> None:
    print(f"cudabuild: error: {one_line(error)}", file=sys.stderr)
    if os.environ.get("CUDABUILD_VERBOSE"):
        raise error
    sys.exit(2)


def make_runner(cli: dict[str, str]) -> Runner:
    store = Store()
    config = load_config(project_root(), cli, store)
    if config.target_note:
        print(config.target_note, file=sys.stderr)
    return Runner(config, store, RUN_ID)


def _stage_action(runner: Runner, stage):
    def action():
        try:
            runner.execute(stage)
        except CudabuildError as e:
            return TaskFailed(one_line(e))
        return True

    return action


def export_tasks(runner: Runner, group: str = "export"):
    config = runner.config
    stages = plan(config)
    for stage in stages:
        yield {
            "name": stage.id,
            "doc": f"{stage.kind} {stage.method or ''}".strip(),
            "actions": [_stage_action(runner, stage)],
            "uptodate": [lambda stage=stage: runner.is_up_to_date(stage)],
            "task_dep": [f"{group}:{d.id}" for d in dependencies(stage, config)],
            "verbosity": 2,
        }

    def manifest():
        if runner.config.autotune == "pin":
            try:
                path = runner.pin_autotune()
            except CudabuildError as e:
                return TaskFailed(one_line(e))
            print(f"autotune decisions pinned in {path.relative_to(runner.config.project)}")
        manifest = runner.write_manifest()
        print_summary(manifest, time.monotonic() - STARTED, runner.config.build_dir)
        return True

    yield {
        "name": "manifest",
        "doc": "write manifest.json and the summary",
        "actions": [manifest],
        "uptodate": [False],
        "task_dep": [f"{group}:{s.id}" for s in stages],
        "verbosity": 2,
    }


def task_export():
    """Build a model: doit export model=NAME [target=auto|cpu|cuda] [OPTION=V] [SPEC=V] [METHOD.SPEC=V]"""
    try:
        runner = make_runner(cli_vars())
    except CudabuildError as e:
        fail_fast(e)
    yield from export_tasks(runner)


DOIT_CONFIG = {
    "default_tasks": ["export"],
    "reporter": CudabuildReporter,
    "verbosity": 2,
}

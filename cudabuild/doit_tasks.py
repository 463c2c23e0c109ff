"""The stage graph as doit tasks. dodo.py hands doit what one `DoitRun` here makes; importing this
module does nothing.

Owns turning builds into doit tasks for one run of doit: the run's id and start, its worker count
and kind, the tasks' stages (what the reporter and the ready queue ask about them). Must not touch:
what a stage does or whether it runs (the runner), a build's configuration (cudabuild.config).

Each stage is a sub-task of `export` (`export:compile.decode`, ...), ordered by `task_dep`. Its
`uptodate` check asks the runner whether the stamp in build/ holds the current action key, and
its action brings the stage up to date (cached / restored / ran). doit's own database only
remembers what the store already knows: deleting `.doit.db` loses nothing. A last sub-task,
`export:manifest`, always runs: it writes build/<model>/<target>/manifest.json and prints the
summary. Bad input stops the load with one line and exit status 2, before anything runs.

`nightly` builds many (model, target) pairs at once with the same sub-tasks, named
`nightly:<model>/<target>:<stage>`, plus `nightly:report` (see cudabuild.engine.nightly). With
`cluster=ADDRESS` (or $DASK_SCHEDULER_ADDRESS; `local` for a cluster of this machine), a stage that
must run is sent to a Dask cluster's workers (cudabuild.engine.cluster): doit's workers are then
threads of this one process, each waiting on its stage's task (`-n N`: stages in flight, default
CLUSTER_IN_FLIGHT).

doit's own API, where it has one: DOIT_CONFIG (the worker count and kind, the reporter, the
default task), task creators (`task_export`, `task_nightly`: the bound methods of the run, called
when doit loads the tasks), doit's reporter class interface, TaskFailed. Where doit has none, and
why:
- the command line, read before doit hands it over (cudabuild.doit_argv: doit's own option tables
  and parser, cmdparse). doit imports dodo.py and reads DOIT_CONFIG right after, before any task
  creator runs and with no hook between, and DOIT_CONFIG's worker count and kind follow `-n`, `-P`,
  `target=` and `cluster=`; doit opens `.doit.db` (`--db-file`, `--backend`) right after that.
  A build's settings are every NAME=VALUE given, which `doit.get_var` (one name at a time) cannot
  list: they are read with the words, by doit's rule (the last value of a name wins).
- the ready queue's order (cudabuild.engine.priority.ordered_ready replaces doit's
  TaskControl.task_dispatcher to order its `ready` deque): doit has no setting for it.
- the reporter's knowledge of the stages: doit builds the reporter itself from the class in
  DOIT_CONFIG, handing it only (outstream, options), so the class is made per run
  (CudabuildReporter.bound).
"""

from __future__ import annotations

import contextlib
import dbm
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from doit.exceptions import TaskFailed

from cudabuild import detached, doit_argv, environment, warm_stage
from cudabuild.engine import admission, cache_admin, cluster, executors, frames, history, interrupt, nightly, priority, room, warm, workers
from cudabuild.engine import manifest as build_manifest
from cudabuild.engine.console import terminal, trace
from cudabuild.config import load_config, load_reporting, model_note
from cudabuild.errors import (ClusterNeedsTier, CudabuildError, InvalidConfig, InvalidOption, NoGpu, UnknownModel,
                              UnknownTarget, error_lines, one_line)
from cudabuild.engine.files import atomic_write_text
from cudabuild.registry import list_models
from cudabuild.engine.console.progress import CudabuildReporter, failure_lines, print_summary
from cudabuild.engine.graph import Stage
from cudabuild.engine.runner import Runner
from cudabuild.engine.store import Store
from cudabuild.backend.toolchain import require_device
from cudabuild.backend.tuning import pin_autotune

DEVICE_BUILD_WORKERS = 3
# Stages of a nightly on a cluster that are in flight at once, unless `-n N` says: each one is a
# thread of the driver waiting on its task, so this only bounds what the cluster is offered.
CLUSTER_IN_FLIGHT = 32


def project_root() -> Path:
    return Path(os.environ.get("CUDABUILD_PROJECT") or os.getcwd()).resolve()


def fail_fast(error: CudabuildError) -> None:
    for line in error_lines(error):
        print(f"cudabuild: error: {line}", file=sys.stderr)
    if os.environ.get("CUDABUILD_VERBOSE"):
        raise error
    sys.exit(2)


class DoitRun:
    """One run of doit on dodo.py: its command line as doit reads it, its id and start, its worker
    count and kind, and the stages its tasks hold. dodo.py makes one when doit imports it (doit
    reads DOIT_CONFIG right then) and hands doit its `doit_config()` and its task creators.

    A build `cudabuild start` runs is given its id by its keeper (cudabuild.detached), which then
    knows its stamps from those of any other build of the folder; it is taken out of the
    environment so that no process this build starts takes it for its own.
    """

    def __init__(self, argv: Optional[list[str]] = None, environ=os.environ):
        self.line = doit_argv.CommandLine.read(sys.argv[1:] if argv is None else argv)
        self.run_id = environ.pop(detached.RUN_ENV, "").strip() or uuid.uuid4().hex
        self.started, self.started_at = time.monotonic(), time.time()
        # The Dask cluster a `nightly` is sent to ("" for none); its stages' threads, else doit's
        # worker processes (cudabuild.engine.workers): the default, unless the command line says
        # `-n N`. Every stage's admission to run beside others is judged with the real count.
        self.cluster = self._cluster_address()
        self.default_workers = CLUSTER_IN_FLIGHT if self.cluster else self._default_workers()
        self.workers = self.line.workers(self.default_workers)
        # task name -> (runner, stage): what the reporter and the ready queue ask about a task.
        self.stages: dict[str, tuple[Runner, Stage]] = {}
        # task name -> its rank (cudabuild.engine.priority), computed when doit first picks among ready tasks.
        self.ranks: dict[str, float] = {}

    def doit_config(self) -> dict:
        """What dodo.py hands doit as DOIT_CONFIG."""
        return {
            "default_tasks": ["export"],
            # 0 is doit's in-process runner: one stage at a time without a worker process.
            "num_process": self.default_workers if self.default_workers > 1 else 0,
            "par_type": "thread" if self.cluster else "process",  # on a cluster, one driver process holds the one connection
            "reporter": CudabuildReporter.bound(self._expected_seconds, self._stage_outcome),
            "verbosity": 2,
        }

    # -- before doit loads the tasks ------------------------------------------------------------

    def _default_workers(self) -> int:
        """One worker per core (cudabuild.engine.workers), except for a build for a device target that
        $CUDABUILD_JOBS says nothing about: three there, a chain per method and the eager references
        beside them. Compile, verify and reference are nearly all of such a build's time; a compile
        mostly keeps the host busy (lowering, codegen, the C++ compile), so the two methods' compiles
        overlap on one GPU, and a reference needs only its export, so it runs while they compile.
        Measured on the H200, tiny_lm cold (bench/cuda_target.py): two workers 69 s against one's 97 s,
        when the reference was still part of verify; four workers took 1.17x one's time back when every
        first-build device stage took the device alone, their imports and compile pools competing."""
        try:
            if not os.environ.get(workers.JOBS_ENV, "").strip() and _builds_for_a_device(self.line.settings):
                return min(DEVICE_BUILD_WORKERS, workers.default_workers())
            return workers.default_workers()
        except CudabuildError:  # a bad $CUDABUILD_JOBS: said by the check before anything runs (checked_start)
            return 1

    def _cluster_address(self) -> str:
        """The Dask cluster a `nightly` is sent to ("" for none): cluster=, else $DASK_SCHEDULER_ADDRESS."""
        if not self.line.requested("nightly"):
            return ""
        address = cluster.address_from(self.line.settings.get("cluster", ""))
        if address and self.line.options.get("par_type") not in (None, "thread"):
            fail_fast(InvalidOption(f"cluster={address} runs doit's workers as threads that wait on the cluster's tasks",
                                    fix="drop -P/--parallel-type"))
        return address

    def recover_doit_db(self) -> None:
        """Remove doit's database when it cannot be read, so the build goes on from the stamps and the store.

        doit opens `.doit.db` right after importing dodo.py and stopped with a traceback when it was
        damaged (garbage bytes, a write cut short by a kill, two builds of one project writing it at
        once). It only remembers what the stamps and the store already know, so losing it costs nothing.
        """
        path = self.line.options.get("dep_file") or ".doit.db"
        backend = self.line.options.get("backend")
        if (backend if backend is not None else "dbm") != "dbm":
            return
        files = [f for f in [path] + [path + s for s in (".dat", ".dir", ".bak", ".db", ".pag")] if os.path.exists(f)]
        if not files:
            return
        try:
            with dbm.open(path, "r") as db:
                for key in db.keys():
                    json.loads(db[key])  # doit keeps one JSON document per task
            return
        except Exception as e:  # whatever stops this read stops doit's too
            reason = one_line(e)
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(f)
        print(f"cudabuild: warning: doit's database {path} was unreadable ({reason}); removed it, "
              "the stamps and the cache still know every build", file=sys.stderr)

    def handle_interrupts(self) -> None:
        """Ctrl-C or SIGTERM: one line saying what is kept, every process of the build ended first,
        exit status 130 (cudabuild.engine.interrupt). dodo.py calls it: doit's own process only."""
        interrupt.install(self._stages_done)

    def checked_start(self) -> list[str]:
        """What is wrong before any build is configured, one line each: the CUDABUILD_* variables
        (cudabuild.environment), a setting given two values, a word that names no task. Raises them
        at once where a word names no task: what the settings were meant for is not known."""
        argv = list(self.line.argv)
        named = {word: "target" if word in ("auto", "cpu", "cuda") else "model"
                 for word in [*list_models(project_root()), "auto", "cpu", "cuda"]}
        found = environment.check() + doit_argv.given_twice(argv)
        stray = doit_argv.stray_words(argv, ("export", "nightly"), named)
        if stray:
            raise InvalidConfig(found + stray)
        return found

    # -- what the reporter and the ready queue ask of a task ------------------------------------

    def _expected_seconds(self, task_name: str):
        runner, stage = self.stages.get(task_name, (None, None))
        return history.expected_seconds(runner, stage) if runner is not None else None

    def _stage_outcome(self, task_name: str):
        """(status, seconds) of what this build did with the task's stage, from its stamp (a stage run
        by a doit worker or a warm process wrote it), or None."""
        runner, stage = self.stages.get(task_name, (None, None))
        stamp = runner.read_stamp(stage) if runner is not None else None
        return (stamp.status, stamp.seconds) if stamp is not None and stamp.run == runner.run_id else None

    def _stages_done(self):
        """(stages up to date, stages) over this run's builds, or None: what `cudabuild explain` would
        say of each stage now (one decision for both), a stage that waits on an unfinished one not done."""
        from cudabuild.engine.explain import forecast

        done = 0
        for runner in {id(r): r for r, _ in list(self.stages.values())}.values():
            try:
                done += sum(f.verdict == "up to date" for f in forecast(runner))
            except Exception:  # a build that cannot be forecast now: none of its stages are counted
                pass
        return (done, len(self.stages)) if self.stages else None

    def _rank_of(self, task_name: str) -> float:
        if not self.ranks and self.stages:
            for runner in {id(r): r for r, _ in self.stages.values()}.values():
                names = {stage: name for name, (r, stage) in self.stages.items() if r is runner}
                ranked = priority.ranks(names, lambda s, r=runner: r.pipeline.dependencies(s, r.config),
                                        lambda s, r=runner: history.expected_seconds(r, s))
                self.ranks.update((names[stage], rank) for stage, rank in ranked.items())
        return self.ranks.get(task_name, 0.0)

    # -- the tasks --------------------------------------------------------------------------------

    def make_runner(self, cli: dict[str, str]) -> Runner:
        found = self.checked_start()
        store = open_store(found)
        config = load_reporting(found, project_root(), cli, store)
        if self.line.builds:
            require_device(config.target)
            for note in (model_note(project_root(), cli), config.target_note):
                if note:
                    print(note, file=sys.stderr)
        return with_warm(Runner(config, store, self.run_id, capture_output=not terminal.streaming(), workers=self.workers),
                         cli)

    def export_tasks(self, runner: Runner, group: str = "export", prefix: str = ""):
        """The sub-tasks of one build, named `<group>:<prefix><stage>` (prefix: to hold several builds).
        A free worker takes the ready one with the longest chain after it first (cudabuild.engine.priority)."""
        config = runner.config
        stages = runner.pipeline.plan(config)
        priority.ordered_ready(self._rank_of)
        self.ranks.clear()
        for stage in stages:
            self.stages[f"{group}:{prefix}{stage.id}"] = (runner, stage)
            yield {
                "name": prefix + stage.id,
                "doc": f"{stage.kind} {stage.method or ''}".strip(),
                "actions": [_stage_action(runner, stage)],
                "uptodate": [lambda stage=stage: runner.is_up_to_date(stage)],
                "task_dep": [f"{group}:{prefix}{d.id}" for d in runner.pipeline.dependencies(stage, config)],
                "verbosity": 2,
            }

        def manifest():
            if runner.config.autotune == "pin":
                try:
                    path = pin_autotune(runner)
                except CudabuildError as e:
                    return TaskFailed(one_line(e))
                print(f"autotune decisions pinned in {path.relative_to(runner.config.project)}")
            with runner.recorder.span("manifest", "build"):
                manifest = build_manifest.write(runner)
            # The cache's size limit ($CUDABUILD_CACHE_MAX_SIZE), once the build is done: what it
            # evicts is referenced by no stamp of the project, so nothing this build needs.
            cache_admin.enforce_limit(runner.store, runner.config.project)
            runner.recorder.merge(trace.process_start_us(), trace.now_us(), model=manifest["model"], target=manifest["target"])
            print_summary(manifest, time.monotonic() - self.started, runner.config.build_dir, shown=runner.config.shown_options,
                          not_cached=build_manifest.not_in_cache(runner.store, manifest["stages"]))
            warm_call = getattr(runner.executor, "call", None)  # (None where it could not serve this build)
            if isinstance(warm_call, warm_stage.WarmStages):
                warm_call.after_build([entry["status"] for entry in manifest["stages"]])
            return True

        yield {
            "name": prefix + "manifest",
            "doc": "write manifest.json and the summary",
            "actions": [manifest],
            "uptodate": [False],
            "task_dep": [f"{group}:{prefix}{s.id}" for s in stages],
            "verbosity": 2,
        }

    def task_export(self):
        """Build a model: doit export model=NAME [target=auto|cpu|cuda] [OPTION=V] [SPEC=V] [METHOD.SPEC=V]"""
        if self.line.requested("nightly") and not self.line.requested("export"):
            return
        try:
            runner = self.make_runner(dict(self.line.settings))
            if self.line.builds:
                # What killed stages left in the cache's work folders (a SIGKILL, a warm call that did
                # not unwind in time) goes before anything is measured or built.
                runner.store.objects.sweep_work()
            if self.line.requested("export") and self.line.builds:
                check_room(runner)
                admission.device_preflight(runner)
        except CudabuildError as e:
            fail_fast(e)
        yield from self.export_tasks(runner)

    def task_nightly(self):
        """Build every recipe for the targets, in parallel: doit -n 4 nightly [models=A,B] [targets=cpu,cuda] [cluster=ADDRESS]

        Each (model, target) gets export's stage sub-tasks as `nightly:<model>/<target>:<stage>`, so
        `doit -n N` spreads them over N worker processes; a build that fails is reported and skipped
        without stopping the others (no --continue needed). `nightly:report` then writes
        build/nightly.json (per build: status, times, cache statistics) and exits non-zero if any
        build failed. targets defaults to auto; other NAME=VALUE settings apply to every build.
        With cluster=ADDRESS (a Dask scheduler, or `local`) the stages that must run run on its
        workers, and `resources=KIND:NAME=AMOUNT,...` adds to what stages of a kind ask of them.
        """
        if not self.line.requested("nightly"):
            return
        try:
            found = self.checked_start()
            if found:
                raise InvalidConfig(found)
        except CudabuildError as e:
            fail_fast(e)
        cli = dict(self.line.settings)
        project = project_root()
        cli.pop("cluster", None)
        resources = cli.pop("resources", "")
        models = [m for m in cli.pop("models", "").split(",") if m] or list_models(project)
        targets = [t for t in cli.pop("targets", "").split(",") if t] or ["auto"]
        store = Store()
        if self.line.builds:
            store.objects.sweep_work()  # what killed stages left (see task_export)
        pool = None
        try:
            if self.cluster:
                pool = open_pool(self.cluster, resources, store)
            elif resources:
                raise InvalidOption(f"resources={resources} is what stages ask of a cluster's workers",
                                    fix="give cluster=ADDRESS too (or drop it)")
        except CudabuildError as e:
            fail_fast(e)
        journal = nightly.Journal(project, self.run_id)
        builds: dict[str, tuple[Runner | None, str | None]] = {}  # "model/target" -> (runner, load error)
        notes = set()
        for model in models:
            for target in targets:
                try:
                    config = load_config(project, dict(cli, model=model, target=target), store)
                except (UnknownModel, UnknownTarget, InvalidOption) as e:  # a typo on the command line
                    fail_fast(e)
                except CudabuildError as e:  # a broken recipe: that build fails, the others go on
                    builds[f"{model}/{target}"] = (None, one_line(e))
                    continue
                if pool is None and self.line.builds:  # a cluster's workers bring their own GPUs
                    try:
                        require_device(config.target)
                    except NoGpu as e:
                        fail_fast(e)
                if config.target_note and config.target_note not in notes and self.line.builds:
                    notes.add(config.target_note)
                    print(config.target_note, file=sys.stderr)
                runner = Runner(config, store, self.run_id, capture_output=not terminal.streaming(), workers=self.workers)
                if pool is not None:  # stages that must run go to the cluster; what a worker needs to configure the same build
                    runner.executor = executors.ClusterWorker(
                        pool.hand_off({"project": str(project), "settings": dict(cli, model=model, target=config.target)}))
                with_warm(runner, dict(cli, model=model, target=config.target))
                builds.setdefault(f"{config.model}/{config.target}", (runner, None))

        for build, (runner, _) in builds.items():
            if runner is None:
                continue
            stages = {s.id: s for s in runner.pipeline.plan(runner.config)}
            for task in self.export_tasks(runner, "nightly", prefix=build + ":"):
                step = task["name"].rpartition(":")[2]
                stage = stages.get(step)
                status = (lambda stage=stage, runner=runner: runner.statuses.get(stage.id, "cached")) if stage else (lambda: "ok")
                task["actions"] = [nightly.contained(journal, build, step, task["actions"][0], status)]
                yield task

        def report():
            summaries = []
            for build, (runner, load_error) in builds.items():
                manifest = None
                if runner is not None and (runner.config.build_dir / "manifest.json").is_file():
                    manifest = json.loads((runner.config.build_dir / "manifest.json").read_text())
                summaries.append(nightly.summarise(build, journal.entries(build), manifest, load_error))
            remote = store.remote.server_info() if store.remote is not None else None
            data = nightly.report(summaries, self.started_at, remote, pool.summary() if pool is not None else None)
            if pool is not None:
                pool.close()
            atomic_write_text(project / "build" / "nightly.json", json.dumps(data, indent=1))
            journal.clear()
            nightly.print_report(data)
            failed = [b for b in summaries if b["status"] != "ok"]
            if failed:
                names = ", ".join(f"{b['model']}/{b['target']}" for b in failed)
                return TaskFailed(f"{len(failed)} of {len(summaries)} nightly builds failed ({names}); see build/nightly.json")
            return True

        yield {
            "name": "report",
            "doc": "write build/nightly.json and the summary",
            "actions": [report],
            "uptodate": [False],
            "task_dep": [f"nightly:{build}:manifest" for build, (runner, _) in builds.items() if runner is not None],
            "verbosity": 2,
        }


def _builds_for_a_device(cli: dict[str, str]) -> bool:
    from cudabuild.backend.toolchain import resolve_target

    try:
        return resolve_target(cli.get("target") or "auto")[0] != "cpu"
    except CudabuildError:  # an unknown target: the build's own checks report it, in their words
        return False



def open_store(found: list[str]) -> Store:
    """The store; one that cannot open (its folder a file, a remote tier's bad URL) adds its line to
    what was `found` before it."""
    try:
        return Store()
    except CudabuildError as e:
        raise InvalidConfig(found + [line for line in error_lines(e) if line not in found]) from None



def with_warm(runner: Runner, settings: dict[str, str]) -> Runner:
    """The runner, its stages that must run sent to the cache's warm process (cudabuild.engine.warm):
    by default (on the GPU machine as spares, since inductor's import initialises the CUDA driver),
    never with CUDABUILD_WARM=0. None is started before a stage must run (cudabuild.warm_stage says
    when one is)."""
    if isinstance(runner.executor, executors.InProcess) and warm.enabled(default=True):
        runner.executor = executors.WarmProcess(warm_stage.WarmStages(runner, settings))
    return runner



def _stage_action(runner: Runner, stage):
    def action():
        try:
            frames.on_fresh_chunk(runner.execute, stage)  # the same frame layout in doit's process and its workers
        except CudabuildError as e:  # one line, then where the stage's own output went
            # No manifest follows a failure: the timeline up to it is written now.
            runner.recorder.merge(trace.process_start_us(), trace.now_us(), failed=stage.id)
            return TaskFailed(one_line(e) + failure_lines(runner.logs.get(stage.id), error=e))
        return True

    return action



def check_room(runner: Runner) -> None:
    """A build that writes weights the disk cannot hold is refused now, before its first stage
    (cudabuild.engine.room): a first build, and one of new weights (another seed, another
    checkpoint), which stores them in the cache and writes a new .ptd into build/."""
    config = runner.config
    if not config.weights_bytes:
        return
    # The stages that store the weights: the quantize stage's bundle, else the exports' weight files.
    plan = runner.pipeline.plan(config)
    writers = [s for s in plan if s.kind == "quantize"] or [s for s in plan if s.kind == "export"]
    if (config.build_dir / ".stamps" / "package.json").exists() and all(
            runner.decide(s).verdict == "cached" for s in writers):
        return  # the weights built here already: what a no-op build decides anyway (no store, no torch)
    # Weights the cache holds already (their stages up to date or restorable) need no room there:
    # a restore writes build/'s .ptd alone.
    from cudabuild.engine.explain import forecast

    verdicts = {f.stage: f.verdict for f in forecast(runner)}
    cached = all(verdicts.get(s.id) in ("up to date", "restorable") for s in writers)
    defaults = config.description.get("options") or {}
    chosen = [f"{k}={v}" for k, v in config.options.items() if defaults.get(k) != v]
    what = f"{config.model}/{config.target}" + (f" ({', '.join(chosen)})" if chosen else "")
    room.check(config.weights_bytes, runner.store.root, config.build_dir, what, weights_cached=cached)



def open_pool(address: str, resources: str, store: Store) -> cluster.Pool:
    """The run's connection to the cluster at `address`, once the shared tier that moves the
    artifacts is known to be there and writable, and the scheduler (not a local one) answered.
    Every problem is one CudabuildError, before anything is built."""
    from cudabuild.backend.cuda_env import visible_gpus
    from cudabuild.cluster_worker import run_stage

    extra = cluster.parse_resources(resources)
    remote = store.remote
    if remote is None:
        raise ClusterNeedsTier(address)
    if not remote.writable:
        raise ClusterNeedsTier(address, f"{remote.where} is read-only here (CUDABUILD_REMOTE_MODE)")
    if remote.server_info() is None:
        raise ClusterNeedsTier(address, f"{remote.where} does not answer")
    pool = cluster.Pool(address, run_stage, remote.where, extra=extra, local_workers=workers.default_workers(),
                        local_gpus=visible_gpus())
    return pool.connect()


"""What `doit export` prints: progress while stages run, one line per failure (with the stage's log),
and a one-screen summary at the end (the options used, per stage ran/cached/restored/remote and
seconds, total time, and the stage time the cache saved: the served stages' last runs added up,
which is more than a build's wall time when they ran side by side).

Progress has two forms. On a terminal (and not under CI=true), rich draws one live line per
running stage with its elapsed time and, where known, how long its last run took; each finished
stage leaves one line above them. Otherwise, plain lines: `> stage`, `still running, Ns elapsed`
every CUDABUILD_PROGRESS_SECONDS, `done in`. Under `doit -n N` every worker's events reach this one
reporter, so everything here is keyed by task. Everything goes to the terminal's own streams
(terminal.py), never into a stage's log.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

from cudabuild.engine import interrupt
from cudabuild.engine.console import terminal
from cudabuild.engine.explain import not_cached_words


def _tick_seconds(default: float = 15.0) -> float:
    """$CUDABUILD_PROGRESS_SECONDS; a bad value is the default here (this is read at import, where
    it cannot stop with a traceback): the check before anything runs (cudabuild.environment) says it."""
    try:
        seconds = float(os.environ.get("CUDABUILD_PROGRESS_SECONDS") or default)
    except ValueError:
        return default
    return seconds if 0 < seconds < float("inf") else default


TICK_SECONDS = _tick_seconds()

# task name -> (status, seconds) of what its stage did in this build (its stamp), or None.
Outcomes = Callable[[str], Optional[tuple[str, float]]]


def _nothing_known(name: str) -> None:
    return None


def done_words(elapsed: float, outcome: Optional[tuple[str, float]]) -> str:
    """How a finished stage's line reads. The elapsed time runs from the stage's start here, so it
    holds what came before the stage's own work (the worker importing torch, waiting for its turn
    or for a warm process); the summary's seconds are that own work alone, so the line names both."""
    status, own = outcome or ("ran", None)
    verb = {"ran": "done", "restored": "restored", "remote": "restored from the shared cache",
            "cached": "up to date"}.get(status, "done")
    words = f"{verb} in {elapsed:.1f}s"
    if own is not None and elapsed - own >= 0.1:
        words += f" ({own:.1f}s running, {elapsed - own:.1f}s importing and waiting)"
    return words


def _stage_id(task_name: str) -> str:
    return task_name.split(":", 1)[-1]  # export:compile.decode, nightly:tiny_lm/cpu:compile.decode


def _label(task_name: str) -> str:
    return _stage_id(task_name).replace(".", " ")


def live_terminal(stream=None, environ=os.environ) -> bool:
    stream = stream or terminal.out()
    # A terminal that cannot move its cursor (TERM=dumb: Emacs' shell, some CI) gets plain lines.
    return (bool(getattr(stream, "isatty", lambda: False)()) and environ.get("CI", "").lower() not in ("1", "true")
            and environ.get("TERM", "") != "dumb")


class PlainProgress:
    """A line when a stage starts, a line every TICK_SECONDS while it runs, a line when it ends."""

    def __init__(self, stream, tick: float = TICK_SECONDS, outcome: Outcomes = _nothing_known):
        self.stream, self.tick, self.outcome = stream, tick, outcome
        self._running: dict[str, tuple[float, threading.Event]] = {}

    def start(self, name: str, expected: Optional[float]) -> None:
        self.stream.write(f"> {_label(name)}\n")
        started, stop = time.monotonic(), threading.Event()
        self._running[name] = (started, stop)
        last = f" (its last run took {expected:.0f}s)" if expected else ""

        def tick():
            while not stop.wait(self.tick):
                self.stream.write(f"  {_stage_id(name)} still running, {time.monotonic() - started:.0f}s elapsed{last}\n")

        threading.Thread(target=tick, daemon=True).start()

    def finish(self, name: str, ok: bool) -> None:
        started, stop = self._running.pop(name, (None, None))
        if stop is None:
            return
        stop.set()
        if ok:
            self.stream.write(f"  {_stage_id(name)} {done_words(time.monotonic() - started, self.outcome(name))}\n")

    def close(self) -> None:
        for name in list(self._running):
            self.finish(name, ok=False)

    stop = close  # a stage that did not finish prints nothing here


class LiveProgress:
    """rich's live display: a spinner line per running stage, a line per finished one."""

    def __init__(self, stream, outcome: Outcomes = _nothing_known):
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.description:<20}"), TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[last]}"), console=Console(file=stream), transient=True,
        )
        self._tasks: dict[str, tuple[int, float]] = {}
        self.outcome = outcome

    def start(self, name: str, expected: Optional[float]) -> None:
        if not self._tasks:
            self._progress.start()
        last = f"last run {expected:.0f}s" if expected else ""
        self._tasks[name] = (self._progress.add_task(_label(name), total=None, last=last), time.monotonic())

    def finish(self, name: str, ok: bool) -> None:
        task, started = self._tasks.pop(name, (None, 0.0))
        if task is None:
            return
        self._progress.remove_task(task)
        elapsed = time.monotonic() - started
        words = f"[green]{done_words(elapsed, self.outcome(name))}[/green]" if ok else f"[red]failed[/red] in {elapsed:.1f}s"
        self._progress.console.print(f"  {_label(name):<20} {words}")
        if not self._tasks:
            self._progress.stop()

    def close(self) -> None:
        for name in list(self._tasks):
            self.finish(name, ok=False)
        self._progress.stop()

    def stop(self) -> None:
        """Take the live lines down and print nothing (an interrupted build says one line itself)."""
        for task, _ in self._tasks.values():
            self._progress.remove_task(task)
        self._tasks.clear()
        self._progress.stop()


class CudabuildReporter(ConsoleReporter):
    """doit's reporter for a build. doit makes it itself, from the class DOIT_CONFIG names, handing it
    only (outstream, options): what it knows of a build's stages comes with the class (`bound`)."""

    desc = "cudabuild progress and summary"
    # task name -> seconds its stage took last time, or None; and what its stage did in this build.
    expected: Callable[[str], Optional[float]] = staticmethod(_nothing_known)
    outcome: Outcomes = staticmethod(_nothing_known)

    @classmethod
    def bound(cls, expected: Callable[[str], Optional[float]], outcome: Outcomes) -> type:
        """This reporter, knowing a run's stages: how long each took last time, what each did now."""
        return type(cls.__name__, (cls,), {"expected": staticmethod(expected), "outcome": staticmethod(outcome)})

    def __init__(self, outstream, options):
        super().__init__(outstream, options)
        if outstream in (sys.stdout, sys.__stdout__):  # doit's default: the terminal, also during stage logs
            self.outstream = terminal.out()
        self.progress = LiveProgress(self.outstream, self.outcome) if live_terminal(self.outstream) else \
            PlainProgress(self.outstream, outcome=self.outcome)
        interrupt.before_exit(self.progress.stop)

    def write(self, text):
        self.outstream.write(text)
        self.outstream.flush()

    def execute_task(self, task):
        if task.name.rpartition(":")[2] == "manifest" or not task.actions:
            return
        self.progress.start(task.name, self.expected(task.name))

    def add_success(self, task):
        self.progress.finish(task.name, ok=True)

    def skip_uptodate(self, task):
        pass

    def add_failure(self, task, fail):
        self.progress.finish(task.name, ok=False)
        self.failures.append({"task": task, "exception": fail})
        if isinstance(fail, TaskFailed):
            message = fail.message
        else:  # an unexpected exception: the last line of its traceback, all of it when verbose
            text = fail.get_msg().strip()
            message = text if os.environ.get("CUDABUILD_VERBOSE") else text.splitlines()[-1]
        self.write(f"cudabuild: error: [{_stage_id(task.name)}] {message.strip()}\n")

    def complete_run(self):
        if interrupt.interrupted():  # doit's runner unwound from Ctrl-C: one line, and exit
            interrupt.finish()
        self.progress.close()
        if self.runtime_errors:
            for msg in self.runtime_errors:
                self.write(f"cudabuild: error: {msg.strip().splitlines()[-1]}\n")


def failure_lines(log: Optional[Path], cwd: Optional[Path] = None, error: Optional[BaseException] = None) -> str:
    """What follows a failed stage's error line: its log's path and the log's last lines that matter,
    but for a full disk (`error`, said in the project's words: cudabuild.engine.room), whose one
    line says what filled and what to do: a library that met it first printed its own traceback of
    it in the log, which would only say the same in other words."""
    from cudabuild.engine import room

    if log is None or not log.exists():
        return ""
    try:
        shown = log.relative_to(cwd or Path.cwd())
    except ValueError:
        shown = log
    tail = [] if error is not None and room.said(error) is not None else terminal.lines_that_matter(log)
    return f"\n  log: {shown}" + "".join(f"\n  | {line}" for line in tail)


def print_summary(manifest: dict, elapsed: float, build_dir: Path, out=None, shown: Optional[dict] = None,
                  not_cached: tuple = ()) -> None:
    """The build's summary. `shown`: how to show an option's value where it needs words
    (`layers=0 (every layer)`); the manifest's value otherwise. `not_cached`: the stages up to
    date in build/ that the cache does not hold (engine.manifest.not_in_cache): the cache saved
    nothing there, and the summary says so."""
    out = out or terminal.out()
    shown = shown or {}
    rows = manifest["stages"]
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("ran", "restored", "remote", "cached")}
    served = [r for r in rows if r["status"] != "ran" and _stage_name(r) not in not_cached]
    saved = sum(r.get("saved_seconds", 0.0) or 0.0 for r in served)
    out.write(f"\n{manifest['model']} / {manifest['target']}\n")
    options = {k: v for k, v in (manifest.get("options") or {}).items() if v != ""}
    if options:  # the values the build used, defaults and what the checkpoint implied included
        out.write("  options: " + ", ".join(f"{k}={shown.get(k, v)}" for k, v in options.items()) + "\n")
    width = max([10] + [len(r["stage"]) + 2 for r in rows])  # a stage kind with a long name keeps its column
    out.write(f"  {'stage':<{width}}{'method':<12}{'status':<10}{'running s':>10}\n")
    for r in rows:
        note = f"  {r['note']}" if r.get("note") else ""
        out.write(f"  {r['stage']:<{width}}{r['method'] or '-':<12}{r['status']:<10}{r['seconds']:>10.1f}{note}\n")
    out.write(
        f"  ran {counts['ran']}, restored {counts['restored']}, "
        + (f"from remote {counts['remote']}, " if counts["remote"] else "")
        + f"cached {counts['cached']}; "
        f"{elapsed:.1f}s total"
        # What the served stages took when they ran, each on its own: stages that ran side by side
        # add up to more than the wall time of the build that ran them.
        + (f"; the cache saved {saved:.1f}s of stage time (the served stages' runs, added up)\n" if saved else "\n")
    )
    try:
        where = build_dir.relative_to(Path.cwd())
    except ValueError:
        where = build_dir
    if not_cached:
        out.write(f"  {not_cached_words(str(where), len(not_cached), counts['cached'])}\n")
    out.write(f"  outputs in {where}/: {', '.join(manifest['outputs']) or 'none'}\n")
    out.flush()


def _stage_name(row: dict) -> str:
    return f"{row['stage']}.{row['method']}" if row["method"] else row["stage"]

"""What `doit export` prints: a line when a stage starts, elapsed time while a long one runs, one
line per failure, and a one-screen summary at the end (per stage ran/cached/restored/remote and
seconds, total time, time saved by the cache).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

TICK_SECONDS = float(os.environ.get("CUDABUILD_PROGRESS_SECONDS", "15"))


def _label(task_name: str) -> str:
    return task_name.split(":", 1)[-1]


class CudabuildReporter(ConsoleReporter):
    desc = "cudabuild progress and summary"

    def __init__(self, outstream, options):
        super().__init__(outstream, options)
        self._ticker = None
        self._started = {}

    def write(self, text):
        self.outstream.write(text)
        self.outstream.flush()

    def execute_task(self, task):
        label = _label(task.name)
        if label.rpartition(":")[2] == "manifest" or not task.actions:
            return
        self._started[task.name] = time.monotonic()
        self.write(f"> {label.replace('.', ' ')}\n")
        self._start_ticker(task.name, label)

    def _start_ticker(self, name, label):
        self._stop_ticker()
        stop = threading.Event()

        def tick():
            while not stop.wait(TICK_SECONDS):
                elapsed = time.monotonic() - self._started.get(name, time.monotonic())
                self.write(f"  {label} still running, {elapsed:.0f}s elapsed\n")

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        self._ticker = (stop, thread)

    def _stop_ticker(self):
        if self._ticker:
            stop, thread = self._ticker
            stop.set()
            thread.join(timeout=1)
            self._ticker = None

    def add_success(self, task):
        self._stop_ticker()
        start = self._started.pop(task.name, None)
        if start is not None:
            self.write(f"  {_label(task.name)} done in {time.monotonic() - start:.1f}s\n")

    def skip_uptodate(self, task):
        pass

    def add_failure(self, task, fail):
        self._stop_ticker()
        self.failures.append({"task": task, "exception": fail})
        if isinstance(fail, TaskFailed):
            message = fail.message
        else:  # an unexpected exception: the last line of its traceback, all of it when verbose
            text = fail.get_msg().strip()
            message = text if os.environ.get("CUDABUILD_VERBOSE") else text.splitlines()[-1]
        self.write(f"cudabuild: error: [{_label(task.name)}] {message.strip()}\n")

    def complete_run(self):
        self._stop_ticker()
        if self.runtime_errors:
            for msg in self.runtime_errors:
                self.write(f"cudabuild: error: {msg.strip().splitlines()[-1]}\n")


def print_summary(manifest: dict, elapsed: float, build_dir: Path, out=None) -> None:
    out = out or sys.stdout
    rows = manifest["stages"]
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("ran", "restored", "remote", "cached")}
    saved = sum(r.get("saved_seconds", 0.0) or 0.0 for r in rows if r["status"] != "ran")
    out.write(f"\n{manifest['model']} / {manifest['target']}\n")
    out.write(f"  {'stage':<10}{'method':<12}{'status':<10}{'seconds':>9}\n")
    for r in rows:
        out.write(f"  {r['stage']:<10}{r['method'] or '-':<12}{r['status']:<10}{r['seconds']:>9.1f}\n")
    out.write(
        f"  ran {counts['ran']}, restored {counts['restored']}, "
        + (f"from remote {counts['remote']}, " if counts["remote"] else "")
        + f"cached {counts['cached']}; "
        f"{elapsed:.1f}s total, {saved:.1f}s saved by the cache\n"
    )
    try:
        where = build_dir.relative_to(Path.cwd())
    except ValueError:
        where = build_dir
    out.write(f"  outputs in {where}/: {', '.join(manifest['outputs']) or 'none'}\n")
    out.flush()

"""Ctrl-C (or SIGTERM) during a build: one line, every process the build started ended, exit 130.

doit stops on KeyboardInterrupt with a traceback of its runner, and leaves what the stages started
to end on their own (a compiler, inductor's compile workers, a warm process's call; seconds
later, or never). `install()` (dodo.py calls it, in doit's own process only) makes the end
orderly:

1. The first SIGINT or SIGTERM in a build's process (doit's, or one of its worker processes, which
   inherit the handler) raises KeyboardInterrupt there, so the stage running unwinds as it would:
   its compiler is killed (subprocess does that), its work directory removed, a call in flight in
   a warm process hung up and waited for (cudabuild.engine.warm). Nothing half-done is stored:
   a record is written after its blobs, a stamp after its record. Later signals are ignored while
   that goes on (doit sends its workers SIGTERM right after the first).
2. doit's process, once its runner has unwound (the reporter's complete_run calls `finish`), waits
   for its worker processes to end, ends whatever of this build is still running (the process is
   a child subreaper, so a compiler whose parent died is still its descendant; warm processes run
   in their own session and are left alone), prints one line, how many stages are done and kept,
   and exits with 128 + the signal (130 for Ctrl-C). The next build resumes from those stages.

An interrupt before the stages start (while the configuration loads) prints the same line.
Must not touch: the store, the stages' outputs (what is done is kept as it is).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional

# How long doit's worker processes get to unwind (a warm call to be hung up and its process to end)
# before what is left is killed.
UNWIND_SECONDS = 30.0
PR_SET_CHILD_SUBREAPER = 36

_state = {"signal": None, "main": None}
# () -> (stages done and kept, stages in the build), or None where it cannot say.
_counter: Callable[[], Optional[tuple[int, int]]] = lambda: None
_before_exit: list[Callable[[], None]] = []


def install(count_done: Callable[[], Optional[tuple[int, int]]]) -> None:
    """Handle SIGINT and SIGTERM in this process (doit's) and in the worker processes it forks;
    `count_done()` says how many of the build's stages are done when the line is printed."""
    global _counter
    _counter = count_done
    _state["main"] = os.getpid()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    _become_subreaper()
    previous = sys.excepthook

    def excepthook(kind, value, tb):  # an interrupt before doit's runner started (loading the configuration)
        if issubclass(kind, KeyboardInterrupt) and os.getpid() == _state["main"]:
            finish()
        previous(kind, value, tb)

    sys.excepthook = excepthook


def before_exit(callback: Callable[[], None]) -> None:
    """Call `callback` in doit's process before the line is printed (the live progress display stops)."""
    _before_exit.append(callback)


def interrupted() -> bool:
    return _state["signal"] is not None


def _on_signal(signum, frame) -> None:
    if _state["signal"] is not None:
        return  # the first one is being handled: let the unwinding finish
    _state["signal"] = signum
    raise KeyboardInterrupt


def _become_subreaper() -> None:
    """Orphans of this process's descendants become its children (Linux), so a build's processes
    stay findable when the worker that started them is gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def finish() -> None:
    """In doit's process, after an interrupt: end the build's processes, say what is kept, exit."""
    for callback in _before_exit:
        with contextlib.suppress(Exception):
            callback()
    end_descendants(UNWIND_SECONDS)
    try:
        counted = _counter()
    except Exception:
        counted = None
    if counted:
        line = f"interrupted; {counted[0]} of {counted[1]} stages are done and kept, the next build resumes from there"
    else:
        line = "interrupted before any stage started; nothing was changed"
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"cudabuild: {line}\n")
        sys.stderr.flush()
    os._exit(128 + (_state["signal"] or signal.SIGINT))


def end_descendants(unwind_seconds: float) -> None:
    """Wait up to `unwind_seconds` for this process's descendants in its session to end (doit's
    workers unwinding), then kill what is left, and reap them. A descendant in another session
    (a warm process, which outlives builds) and its descendants are left alone."""
    deadline = time.monotonic() + unwind_seconds
    killed = False
    while True:
        _reap()
        left = descendants(os.getpid())
        if not left:
            return
        if time.monotonic() >= deadline or killed:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            killed = True
            if time.monotonic() >= deadline + 10:
                return  # unkillable (a process in uninterruptible I/O): leave it
        time.sleep(0.05)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def descendants(root: int) -> list[int]:
    """The live (not zombie) descendants of `root` in its session, from /proc."""
    table: dict[int, tuple[int, int, str]] = {}  # pid -> (ppid, session, state)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), fields[0])
    session = table.get(root, (0, os.getsid(0), ""))[1]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        ppid, sid, state = table[pid]
        if sid != session:
            continue  # another session: a warm process and what it runs
        if state != "Z":
            found.append(pid)
        todo.extend(children.get(pid, []))
    return found

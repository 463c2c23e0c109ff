"""The terminal: what a person sees, kept apart from what libraries print while a stage runs.

- `out()` / `err()`: the process's own stdout and stderr, duplicated the first time they are asked
  for, so cudabuild's lines (progress, warnings, errors, the summary) reach the terminal while
  file descriptors 1 and 2 point at a stage's log.
- `capture(path)`: for one stage's run, everything written to fds 1 and 2 goes to `path`: Python's
  prints, warnings and logging, and what C++ libraries, Triton and compiler subprocesses write
  (fd-level, because torchao's "Failed to load" lines and inductor's AUTOTUNE tables do not pass
  through sys.stdout). Nothing is captured when `streaming()`: CUDABUILD_VERBOSE=1 or doit's
  `-v 2` on the command line.
- `lines_that_matter(path)`: the end of a log without the noise, for a stage that failed.

Must not touch: what a stage computes; only where its output goes. Engine half.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

_STREAMS: dict[int, io.TextIOWrapper] = {}


def _console(fd: int) -> io.TextIOWrapper:
    if fd not in _STREAMS:
        try:
            _STREAMS[fd] = io.TextIOWrapper(io.FileIO(os.dup(fd), "w"), encoding="utf-8", errors="replace",
                                            line_buffering=True, write_through=True)
        except OSError:  # no such descriptor (a daemon): fall back to whatever Python has
            return sys.stdout if fd == 1 else sys.stderr  # type: ignore[return-value]
    return _STREAMS[fd]


def out() -> io.TextIOWrapper:
    """The terminal's stdout, whatever fd 1 points at now."""
    return _console(1)


def err() -> io.TextIOWrapper:
    return _console(2)


def warn(message: str) -> None:
    """A `cudabuild: warning:` line on the terminal's stderr."""
    err().write(f"cudabuild: warning: {message}\n")


def note(message: str) -> None:
    """A line about the build (waiting for another builder, a rebuild) on the terminal's stdout."""
    out().write(f"  {message}\n")


def streaming(argv: Optional[list[str]] = None, environ=os.environ) -> bool:
    """Stream third-party output as it comes instead of logging it: CUDABUILD_VERBOSE=1, or doit's
    `-v 2` / `--verbosity=2` given on the command line."""
    if environ.get("CUDABUILD_VERBOSE"):
        return True
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        if arg in ("-v", "--verbosity") and i + 1 < len(argv) and argv[i + 1] == "2":
            return True
        if arg in ("-v2", "--verbosity=2"):
            return True
    return False


@contextlib.contextmanager
def capture(path: Path) -> Iterator[Path]:
    """fds 1 and 2 (and so sys.stdout, sys.stderr, warnings, logging) go to `path` in the block."""
    out(), err()  # the terminal's streams exist before fds 1 and 2 move
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield path
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


# Lines a failed stage's log is full of that say nothing about the failure.
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")  # what warnings.showwarning prints
_LIBRARY_LOG = re.compile(r"^[WI]\d{4} \d\d:\d\d:\d\d")  # torch's glog-style warning/info lines
_NOISE = (re.compile(r"^Failed to load .*\.so"),)  # torchao's optional kernels, on every import


def lines_that_matter(path: Path, last: int = 8, width: int = 200) -> list[str]:
    """The last `last` lines of a log that are not warnings (with the source line each echoes),
    library warning/info lines or import noise; each cut to `width` characters."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    kept, after_warning = [], False
    for line in text.splitlines():
        if _WARNING.match(line) or _LIBRARY_LOG.match(line) or any(p.match(line) for p in _NOISE):
            after_warning = True
            continue
        if after_warning and line.startswith((" ", "\t")):
            continue  # the source line a warning echoes, or its continuation
        after_warning = False
        if line.strip():
            line = line.rstrip()
            kept.append(line if len(line) <= width else line[:width - 1] + "…")
    return kept[-last:]

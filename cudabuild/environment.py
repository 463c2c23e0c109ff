"""The CUDABUILD_* environment variables: one table of what each takes, and the one check of them
that `doit export`/`doit nightly` and every `cudabuild` command make before anything runs.

    CUDABUILD_CACHE_MAX_SIZE=lots doit export model=tiny_lm target=cpu
    cudabuild: error: CUDABUILD_CACHE_MAX_SIZE 'lots' is not a size; use bytes or a number with K, M, ...

The modules that use a variable read it where they need it (and some only at the end of a build,
or in a process the build starts), so a bad value used to surface late, or as a traceback at
import. `problems()` says every bad value at once, one line each, with what was expected; the
callers add them to the settings' problems and stop with exit status 2. A CUDABUILD_ name that no
module reads (a typo: CUDABUILD_JOB) is a warning naming the closest known one, not an error: a
variable of another cudabuild version must not stop a build.

Owns the table and the check. Sizes and a remote tier's URLs are parsed by their owners' parsers
(cache_admin.parse_size, tiers.factory.from_env: imported only when such a variable is set, so a
no-op build pays nothing for them); a module that reads its variable at import reads it tolerantly
and leaves the telling to this check. No torch here.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from cudabuild.errors import compose

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
# Names tests put in a build's environment to find its processes again (tests/test_hardening.py).
_TEST_PREFIX = "CUDABUILD_TEST_"


@dataclass(frozen=True)
class Variable:
    name: str
    # (value, environ) -> None, or what is wrong with the value: the line's end after `NAME=VALUE: `,
    # or (a check that reuses its owner's parser, whose message names the variable) the whole line.
    check: Callable[[str, Mapping[str, str]], Optional[str]]
    whole_line: bool = False


def _flag(value: str, environ) -> Optional[str]:
    return None if value.strip().lower() in _TRUE + _FALSE else "expected 1 or 0 (true/false, on/off, yes/no)"


def _whole(minimum: int, what: str = "") -> Callable[[str, Mapping[str, str]], Optional[str]]:
    def check(value: str, environ) -> Optional[str]:
        text = value.strip()
        return None if text.isdigit() and int(text) >= minimum else f"expected {what or f'a whole number >= {minimum}'}"
    return check


def _seconds(minimum: float, above: bool = False) -> Callable[[str, Mapping[str, str]], Optional[str]]:
    def check(value: str, environ) -> Optional[str]:
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        fine = (seconds > minimum if above else seconds >= minimum) and seconds < float("inf")
        return None if fine else f"expected a number of seconds {'>' if above else '>='} {minimum:g}"
    return check


def _size(name: str) -> Callable[[str, Mapping[str, str]], Optional[str]]:
    def check(value: str, environ) -> Optional[str]:
        from cudabuild.engine.cache_admin import parse_size
        from cudabuild.errors import CudabuildError

        try:
            parse_size(value.strip(), name)
        except CudabuildError as e:
            return str(e)  # the words `cache gc --max-size` uses: `NAME 'lots' is not a size; use bytes or ...`
        return None
    return check


def _folder(must_exist: bool) -> Callable[[str, Mapping[str, str]], Optional[str]]:
    def check(value: str, environ) -> Optional[str]:
        path = os.path.expanduser(value.strip())
        if os.path.isdir(path):
            return None
        if os.path.exists(path):
            return "is a file; expected a folder"
        return "no such folder; expected an existing folder (the project: dodo.py, recipes/)" if must_exist else None
    return check


def _run_id(value: str, environ) -> Optional[str]:
    return None if re.fullmatch(r"[0-9a-f]{32}", value.strip()) else "expected the 32 hex digits `cudabuild start` gives its build"


def _warm_mode(value: str, environ) -> Optional[str]:
    return None if value.strip().lower() == "spares" else "expected spares (or unset: the CUDA driver's state decides)"


def _remote(value: str, environ) -> Optional[str]:
    """The shared tier's variables together, as the tier reads them (it parses; it connects to nothing)."""
    from cudabuild.engine.tiers.factory import from_env
    from cudabuild.errors import CudabuildError

    try:
        from_env(environ, warn=lambda line: None)
    except CudabuildError as e:
        return str(e)  # the tier's own line, naming its variables
    return None


def _blobs_alone(value: str, environ) -> Optional[str]:
    return None if environ.get("CUDABUILD_REMOTE", "").strip() else _remote(value, environ)


def _any(value: str, environ) -> Optional[str]:
    return None


VARIABLES = (
    Variable("CUDABUILD_CACHE_DIR", _folder(must_exist=False)),
    Variable("CUDABUILD_CACHE_MAX_SIZE", _size("CUDABUILD_CACHE_MAX_SIZE"), whole_line=True),
    Variable("CUDABUILD_PROJECT", _folder(must_exist=True)),
    Variable("CUDABUILD_JOBS", _whole(1, "a whole number of stages to run at once, 1 or more")),
    Variable("CUDABUILD_VERBOSE", _flag),
    Variable("CUDABUILD_DEVICE_MEMORY", _size("CUDABUILD_DEVICE_MEMORY"), whole_line=True),
    Variable("CUDABUILD_HOST_MEMORY", _size("CUDABUILD_HOST_MEMORY"), whole_line=True),
    Variable("CUDABUILD_INDUCTOR_DIR", _folder(must_exist=False)),
    Variable("CUDABUILD_KEEP_INDUCTOR", _flag),
    Variable("CUDABUILD_KERNEL_CACHE", _folder(must_exist=False)),
    Variable("CUDABUILD_PROGRESS_SECONDS", _seconds(0, above=True)),
    Variable("CUDABUILD_SPANS_MIN_REGION", _whole(0, "a whole number of bytes")),
    Variable("CUDABUILD_WARM", _flag),
    Variable("CUDABUILD_WARM_IDLE_SECONDS", _seconds(0)),
    Variable("CUDABUILD_WARM_SPARES", _whole(1, "a whole number of waiting processes, 1 or more")),
    Variable("CUDABUILD_WARM_MODE", _warm_mode),
    # The shared tier's, checked together by the tier's own parser (once: from CUDABUILD_REMOTE, or
    # from CUDABUILD_REMOTE_BLOBS set alone, which the tier refuses).
    Variable("CUDABUILD_REMOTE", _remote, whole_line=True),
    Variable("CUDABUILD_REMOTE_BLOBS", _blobs_alone, whole_line=True),
    Variable("CUDABUILD_REMOTE_KEY", _any),
    Variable("CUDABUILD_REMOTE_MODE", _any),
    Variable("CUDABUILD_REMOTE_LEASE_SECONDS", _any),
    Variable("CUDABUILD_REMOTE_WAIT_SECONDS", _any),
    # Set by `cudabuild start`'s keeper for the build it runs (cudabuild.detached), not by a user.
    Variable("CUDABUILD_RUN_ID", _run_id),
)
NAMES = tuple(v.name for v in VARIABLES)
# Flags that some modules read as set or unset: 0 must mean off there too (normalise).
_SET_OR_UNSET = ("CUDABUILD_VERBOSE", "CUDABUILD_KEEP_INDUCTOR")


def problems(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One line per variable whose value its users cannot take, in the table's order."""
    environ = os.environ if environ is None else environ
    found = []
    for variable in VARIABLES:
        value = environ.get(variable.name, "")
        if not value.strip():
            continue  # unset, or set empty: the default, as every reader takes it
        problem = variable.check(value, environ)
        if problem:
            found.append(problem if variable.whole_line else compose(f"{variable.name}={value}", problem))
    return found


def unknown(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """A warning line per CUDABUILD_ name no module reads, with the known name it is closest to."""
    environ = os.environ if environ is None else environ
    lines = []
    for name in sorted(n for n in environ if n.startswith("CUDABUILD_") and n not in NAMES and not n.startswith(_TEST_PREFIX)):
        close = difflib.get_close_matches(name, NAMES, n=1, cutoff=0.8)
        lines.append(f"{name} is not a variable cudabuild reads; ignored" + (f" (did you mean {close[0]}?)" if close else ""))
    return lines


def normalise(environ=None) -> None:
    """Make CUDABUILD_VERBOSE=0 (false, off, no) mean off: a dozen places, in this process and the
    ones it starts, read such a flag as set or unset; removing it once here is simpler than
    teaching each of them the words."""
    environ = os.environ if environ is None else environ
    for name in _SET_OR_UNSET:
        if environ.get(name, "").strip().lower() in _FALSE:
            environ.pop(name, None)


def check(environ=None) -> list[str]:
    """What a command does first: a warning on stderr per unknown CUDABUILD_ name, the flags
    normalised, and the problems of the values, one line each (the caller reports them with its
    settings' problems, then stops)."""
    environ = os.environ if environ is None else environ
    for line in unknown(environ):
        print(f"cudabuild: warning: {line}", file=sys.stderr)
    found = problems(environ)
    normalise(environ)
    return found

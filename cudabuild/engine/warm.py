"""Warm processes: a stage runs in a process that imported torch already.

Every stage that runs imports torch, ExecuTorch and inductor before it does anything: about 7 s
on this project's 2-core machines, 10 s with two stages importing at once, 12 s for a Qwen3.5-MoE
compile on the H200, in every build, cold or incremental, in each worker process. A rebuild that
compiles one method for 25 s spent 9.6 s of it importing.

So a build starts a warm process (cudabuild/engine/warm_server.py, detached, one per cache and
toolchain; cudabuild.warm_stage says when: a build of several workers at its first stage that must
run, a build of one worker as it ends) that imports those libraries once and stays up until it
has been idle for `$CUDABUILD_WARM_IDLE_SECONDS` (default IDLE_SECONDS). Each stage that runs is then a `call`:
the warm process's worker forks, and the child runs the stage with the caller's environment, working
directory, sys.path and terminal. Where the imports initialised the CUDA driver (the GPU machine),
a fork could not use it, so the call goes instead to one of a few spare processes the server keeps
imported and waiting, which serves that one call (warm_server says how). Only third-party libraries
are imported beforehand; the project's code (cudabuild, the recipes, the models) is read from disk
by each call, so an edit reaches the next build as it does without warm processes. What the call
computes is what the caller would have: the same code on the same inputs, with the same
environment.

Which warm process serves a call is decided by a key over everything the imports could have
read: the Python executable, sys.path, the environment variables libraries read when imported
(IMPORT_TIME_ENV), the modules to import, the server's own source, and the cache it serves, taken
when a WarmProcesses is made (a build's start). A caller whose key differs gets another process, so a changed environment is never served by a process
that imported under the old one. Processes live under /tmp/cudabuild-warm-<uid>/ (a Unix socket's
path must be short), named by that key, beside their logs.

A caller interrupted mid-call (Ctrl-C) hangs up and waits until the process serving the call, and
everything it started, is gone (`hang_up`).

`$CUDABUILD_WARM=0` turns this off: each stage runs in the build's own processes, as before. A
warm process that cannot start (within START_SECONDS) leaves the build to do the same. A no-op
build starts none: only a stage that must run makes a call.

Engine half: what runs in the child is handed in as "module:function" and a payload
(cudabuild.warm_stage for a stage); the modules to import come from the pipeline.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.machinery
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from cudabuild.engine import warm_server
from cudabuild.engine.processes import alive as process_alive
from cudabuild.engine.hashing import digest

ENV = "CUDABUILD_WARM"
IDLE_ENV = "CUDABUILD_WARM_IDLE_SECONDS"
IDLE_SECONDS = 900.0
# A cold import of torch, ExecuTorch and inductor takes 7-12 s; a loaded machine, longer.
START_SECONDS = 180.0
# How long an interrupted caller waits for the process serving its call to end.
HANG_UP_SECONDS = 20.0
# How often a caller waiting for its answer wakes, so that a signal's handler runs (_receive).
WAKE_SECONDS = 0.2
SERVER = Path(__file__).with_name("warm_server.py")
# A server's files (log, sidecar, lock, mode) are removed this long after they last changed,
# once its socket is gone.
STALE_DAYS = 7.0
# Environment variables a library may read while it is imported (and keep): inductor's and
# Triton's config, CUDA's, the C++ compiler's, the linker's, Python's own, threads.
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "TORCHINDUCTOR_", "INDUCTOR", "TRITON_", "CUDA", "NVIDIA", "OMP_", "MKL",
                   "KMP_", "LD_", "PYTHON", "CC", "CXX", "PATH", "HOME", "TMPDIR", "USER", "XDG_")


class WarmUnavailable(Exception):
    """No warm process answers (it could not start, or the platform cannot pass descriptors): run here instead."""


class WarmNotRunning(WarmUnavailable):
    """None answers now, and the caller asked not to start one (cudabuild.warm_stage: a build that
    runs every stage in one process, where a start would cost what it saves)."""


def enabled(default: bool, environ=os.environ) -> bool:
    """$CUDABUILD_WARM (1 or 0) where set, else `default`; never where Unix sockets cannot pass
    file descriptors."""
    value = environ.get(ENV, "").strip().lower()
    wanted = default if not value else value not in ("0", "false", "off", "no")
    return wanted and hasattr(socket, "send_fds")


def idle_seconds(environ=os.environ) -> float:
    try:
        return float(environ.get(IDLE_ENV) or IDLE_SECONDS)
    except ValueError:
        return IDLE_SECONDS


def folder() -> Path:
    return Path("/tmp") / f"cudabuild-warm-{os.getuid()}"


def server_key(cache_root: Path, toolchain: str, environ=os.environ, path: Sequence[str] = ()) -> str:
    """A server's key: its toolchain's (toolchain_key), the whole sys.path, and the cache it serves."""
    return digest({
        "toolchain": toolchain,
        "path": list(path or sys.path),
        "pythonpath": environ.get("PYTHONPATH", ""),
        "cache": str(Path(cache_root).resolve()),
        "spares": environ.get(warm_server.SPARES_ENV, ""),
    })[:24]


def toolchain_key(modules: Sequence[str], environ=os.environ, path: Sequence[str] = ()) -> str:
    """What decides what the imports do (whether they initialise the CUDA driver, among it): the
    Python, where each module's top-level package is found (not the whole sys.path, which holds
    each project's folder) and the variables read at import time."""
    where = {}
    for top in sorted({m.split(".")[0] for m in modules}):
        with contextlib.suppress(Exception):  # finds without importing: a path search
            spec = importlib.machinery.PathFinder.find_spec(top, list(path or sys.path))
            where[top] = spec.origin if spec else None
    return digest({
        "python": sys.executable,
        "packages": where,
        "env": {k: v for k, v in sorted(environ.items()) if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONPATH"},
        "modules": list(modules),
        "server": SERVER.read_bytes().decode(),
        "mode": environ.get(warm_server.MODE_ENV, ""),  # a mode asked for is not the imports' doing
    })[:24]


@dataclass
class WarmProcesses:
    """The warm process of one cache, for the modules a pipeline's stages import."""

    cache_root: Path
    modules: Sequence[str]

    def __post_init__(self):
        # Keyed once, by the environment and sys.path of now (a build's start): a caller's stages
        # add to its sys.path (a project's folder) and the libraries they import set variables
        # of their own, and its later calls, and the server it starts as it ends, must still be
        # the same key's.
        toolchain = toolchain_key(self.modules)
        self._socket = folder() / f"{server_key(self.cache_root, toolchain)}.sock"
        # Where servers of this toolchain note how their imports are served (warm_server's MODE_FILE).
        self.mode_file = folder() / f"{toolchain}.mode"
        self.last_server: Optional[int] = None  # the pid of the server that answered the last call

    def socket_path(self) -> Path:
        return self._socket

    def call(self, function: str, payload, start: bool = True) -> object:
        """`function(payload)` ("module:function") in a fresh fork (or spare) of the warm process; returns
        what it returns, raises what it raised. WarmUnavailable when no warm process can serve;
        with start=False, WarmNotRunning when none answers now (and none is started)."""
        conn = self._connect(start)
        with conn:
            call = {"function": function, "payload": payload, "environ": dict(os.environ), "cwd": os.getcwd(),
                    "path": list(sys.path)}
            data = pickle.dumps(call)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            try:
                with _stdio() as fds:
                    socket.send_fds(conn, [warm_server.HEADER.pack(len(data))], fds)
                conn.sendall(data)
                answer = pickle.loads(_receive(conn))
            except EOFError:
                raise RuntimeError(f"the warm process's child for {function} ended without an answer "
                                   f"(killed? its server's log: {self.log_path()})") from None
            except BaseException:  # interrupted (Ctrl-C): end the call, and wait until what it ran is gone
                hang_up(conn)
                raise
        self.last_server = answer.get("server")
        if "error" in answer:
            if answer["error"] is not None:
                raise answer["error"]
            raise RuntimeError(f"in a warm process:\n{answer['traceback']}")
        return answer["value"]

    def log_path(self) -> Path:
        return self.socket_path().with_suffix(".log")

    def _connect(self, start: bool) -> socket.socket:
        path = self.socket_path()
        conn = _try_connect(path)
        if conn is not None:
            return conn
        if not start:
            raise WarmNotRunning(f"no warm process answers at {path}")
        with self._starter_lock(blocking=True):  # one starter; the others wait here and then connect
            conn = _try_connect(path)
            if conn is not None:
                return conn
            server = self._spawn()
            deadline = time.monotonic() + START_SECONDS
            while time.monotonic() < deadline:
                conn = _try_connect(path)
                if conn is not None:
                    return conn
                if server.poll() is not None:
                    break
                time.sleep(0.05)
            with contextlib.suppress(OSError):
                server.kill()
            server.wait()
            raise WarmUnavailable(f"the warm process did not start (its log: {self.log_path()})")

    def start_in_background(self) -> bool:
        """Start this key's server for a later build and return at once; False where one answers
        already or another caller is starting one."""
        if _try_connect_quietly(self.socket_path()):
            return False
        with self._starter_lock(blocking=False) as locked:
            if not locked or _try_connect_quietly(self.socket_path()):
                return False
            self._spawn()
            return True

    @contextlib.contextmanager
    def _starter_lock(self, blocking: bool) -> Iterator[bool]:
        path = self.socket_path()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True

    def _spawn(self) -> subprocess.Popen:
        """A new server for this key, detached from the caller (it outlives the build)."""
        path = self.socket_path()
        _prune(path.parent, keep=path.stem)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead server's
        with open(self.log_path(), "ab") as log:
            server = subprocess.Popen(
                [sys.executable, str(SERVER), str(path), str(idle_seconds()), ",".join(self.modules), str(self.mode_file)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                start_new_session=True)
        path.with_suffix(".json").write_text(json.dumps(
            {"cache": str(Path(self.cache_root).resolve()), "pid": server.pid, "modules": list(self.modules),
             "python": sys.executable, "started": time.time()}))
        return server


def _receive(conn: socket.socket) -> bytes:
    """warm_server.receive, waking every WAKE_SECONDS while the call runs: Python runs a signal's
    handler in the main thread when it executes, and the kernel may hand the signal (Ctrl-C) to
    another thread of this process, which leaves a blocking recv asleep until the answer comes."""
    conn.settimeout(WAKE_SECONDS)
    return warm_server.receive(conn)


def hang_up(conn: socket.socket, seconds: float = HANG_UP_SECONDS) -> bool:
    """End a call in flight: the process serving it sees its caller leave and kills its process
    group (itself, a compiler, inductor's workers: warm_server); returns once its end of the socket
    is closed, i.e. it is gone (False after `seconds` without that)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + seconds
    conn.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if not conn.recv(1 << 16):
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def running() -> list[dict]:
    """The warm processes of this user: each one's cache, pid, modules, socket, and `starting`
    (True while its imports run: it answers no call yet, and its socket is not there yet)."""
    found = []
    for sidecar in sorted(folder().glob("*.json")):
        sock = sidecar.with_suffix(".sock")
        try:
            process = json.loads(sidecar.read_text())
            alive = process_alive(int(process["pid"])) and _is_server(int(process["pid"]))
        except (OSError, ValueError, KeyError):
            continue
        if alive:
            found.append(dict(process, socket=str(sock), starting=not sock.exists()))
    return found


def stop(process: dict) -> None:
    """Ask a warm process to go: it sees its socket gone, finishes the calls it is running, exits.
    One still starting has no socket to remove and serves nothing yet: it and its importing worker
    (its own session, started so) are ended."""
    if process.get("starting"):
        with contextlib.suppress(OSError):
            os.killpg(int(process["pid"]), signal.SIGTERM)
        return
    with contextlib.suppress(OSError):
        Path(process["socket"]).unlink()


def wait_gone(processes: Sequence[dict], seconds: float) -> list[dict]:
    """Those of `processes` still alive after waiting up to `seconds` for them to exit (a server
    notices its socket gone within a second, then ends its waiting workers; a call being served
    finishes first)."""
    deadline = time.monotonic() + seconds
    left = list(processes)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if process_alive(int(p["pid"]))]
    return left


def resident_bytes(pid: int) -> int:
    """The resident bytes of a warm process and of its workers (what it holds while idle), 0 if gone."""
    total = 0
    for one in [pid, *_children(pid)]:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{one}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(c) for c in children.read().split()]
    except OSError:
        return []


def _is_server(pid: int) -> bool:
    """Whether the pid is a warm server's still (not a pid the system gave to another process since)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return SERVER.name.encode() in cmdline.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust the sidecar
        return True


@contextlib.contextmanager
def _stdio():
    """fds 0, 1 and 2 to hand the child; /dev/null in place of any this process has closed."""
    opened, fds = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            opened.append(os.open(os.devnull, os.O_RDWR))
            fds.append(opened[-1])
    try:
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


def _prune(where: Path, keep: str) -> None:
    """Remove the files of servers long gone (their logs, sidecars, locks and modes: a key a
    day, each changed environment or cache another), so the folder does not grow for ever."""
    cutoff = time.time() - STALE_DAYS * 86400
    for entry in where.iterdir():
        if entry.stem == keep or entry.with_suffix(".sock").exists():
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_mtime < cutoff:
                entry.unlink()


def _try_connect_quietly(path: Path) -> bool:
    conn = _try_connect(path)
    if conn is None:
        return False
    conn.close()  # the server's child sees a caller that connected and left, and exits
    return True


def _try_connect(path: Path) -> Optional[socket.socket]:
    if not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn

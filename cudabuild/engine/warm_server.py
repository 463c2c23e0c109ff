"""The warm process itself: has the heavy libraries imported once, then serves each call with them loaded.

    python cudabuild/engine/warm_server.py SOCKET IDLE_SECONDS MODULE[,MODULE...] MODE_FILE

Started by cudabuild.engine.warm (never by hand), detached from the build that started it. It
runs by path, not as part of the cudabuild package, and imports nothing of cudabuild: what is
imported stays in every process that serves a call, and the project's own code (models, recipes,
cudabuild itself) must be read from disk by each call, or an edit would not reach the next build.
So only the listed third-party modules are imported (a module that fails to import is skipped).

The server itself imports none of them: it owns SOCKET and starts worker processes that import
them and then wait on it. The first worker's imports decide how calls are served:

- Forks, where they left the CUDA driver uninitialised (every CPU machine): that worker forks once
  per call and goes back to listening; it is the only one.
- Spares, where an import initialised the driver (on the GPU machine `torch._inductor.compile_fx`
  calls cuInit; a driver initialised before a fork cannot be used by the children, nor be
  initialised again): each worker serves one call and exits, and the server keeps
  `$CUDABUILD_WARM_SPARES` of them imported and waiting (by default one per two cores, 3 to 8,
  as many as the memory holds: `default_spares`), starting another as soon as one takes a call.
  `$CUDABUILD_WARM_MODE=spares` asks for this mode anywhere.

The first worker's answer is written to MODE_FILE (one per toolchain), so that a later server that
will need spares starts them all at once. Without that answer, a server where an NVIDIA driver is
loaded starts all its spares at once too (the answer there is spares for every torch measured);
elsewhere its first worker is the only one until it answers, since on a 2-core machine spares
importing side by side would slow the build they are for. A server whose workers answer otherwise
than it started for changes mode at the first answer: extra forking workers are closed.

Either way the process that serves takes the caller's stdin, stdout and stderr (passed over the
socket), its environment, working directory and sys.path, imports the named function and runs it
on the payload, and sends back what it returns (or the exception it raised). It runs in a process
group of its own; while it runs, a thread waits for the caller to hang up: a caller that is gone (a
build interrupted) interrupts the call, which unwinds as a stage in a build's own process does (its
work folder removed), then ends it and everything the call started (the group).

SOCKET appears once a worker is ready. The server exits after IDLE_SECONDS without a call and
with no call still running, or as soon as SOCKET is no longer its own (another server took the
name), and removes the socket it made. Standard library only, on purpose: see above. The
caller's side (cudabuild.engine.warm) imports this module for the framing (HEADER, send, receive),
so the two agree by construction.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback

HEADER = struct.Struct("!Q")
CUDA_ERROR_NOT_INITIALIZED = 3
SPARES_ENV = "CUDABUILD_WARM_SPARES"
# "spares" asks for spare mode whatever the driver says (a library that must not be forked, or a
# test on a machine without a driver); unset, the driver decides.
MODE_ENV = "CUDABUILD_WARM_MODE"
# Waiting processes in spare mode. Each that takes a call is replaced at once, but the replacement
# imports for 12-18 s on the GPU machine, so a build must find as many waiting as the stages it
# starts within that time: a tiny_lm cold build on the H200 starts seven (probe, two exports, two
# edges, two references) in its first 15 s, and with three spares its edges and references waited
# 11 s each for imports. Bounded by the cores (each import is a core busy) and by the memory.
SPARES_MIN, SPARES_MAX = 3, 8
SPARE_BYTES = 2 << 30  # what one imported worker holds, rounded up (torch, inductor, ExecuTorch)
# How long MODE_FILE's answer is taken before the first worker has given its own: "spares" starts
# every spare at once, "forks" one worker even where the NVIDIA driver is loaded.
SPARES_DAYS = 7.0
# A worker that dies before it is ready (its import crashed) is started again at most this many
# times in a row; then the server gives up, and its callers run their stages themselves.
WORKER_FAILURES = 3
# The server a worker was started by: each answer names it (what `cudabuild warm` lists).
SERVER_PID = 0


def receive(conn: socket.socket) -> bytes:
    """One framed message (HEADER, then that many bytes)."""
    return exactly(conn, HEADER.unpack(exactly(conn, HEADER.size))[0])


def exactly(conn: socket.socket, size: int) -> bytes:
    """`size` bytes from the socket; EOFError when the other end hangs up first. A socket given a
    timeout (the caller's, which wakes to run its signal handlers: cudabuild.engine.warm) reads on
    after each one."""
    chunks, left = [], size
    while left:
        try:
            chunk = conn.recv(min(left, 1 << 20))
        except socket.timeout:
            continue
        if not chunk:
            raise EOFError("the other end hung up")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send(conn: socket.socket, data: bytes) -> None:
    conn.sendall(HEADER.pack(len(data)) + data)


def _preload(modules: list[str]) -> None:
    for name in modules:
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional library that is not installed here
            print(f"warm: {name} not imported: {type(e).__name__}: {e}", flush=True)
        else:
            print(f"warm: imported {name} in {time.monotonic() - started:.1f}s", flush=True)


# How long a call whose caller hung up gets to unwind (its stage's work folder removed, its
# compiler killed, as a Ctrl-C does in a build's own process) before its group is killed as it is.
UNWIND_SECONDS = 5.0
_caller_left = threading.Event()
_answered = threading.Event()


def _end_group() -> None:
    """This process and everything it started (its process group: _serve_call), at once."""
    try:
        os.killpg(os.getpid(), signal.SIGKILL)
    except OSError:
        pass
    os._exit(3)


def _exit_when_caller_leaves(conn: socket.socket) -> None:
    """The caller sends nothing after its call: the next recv returns only when it hangs up. Then
    the call is interrupted as a Ctrl-C interrupts a stage in a build's own process (KeyboardInterrupt
    in the main thread: the stage unwinds and removes its work folder), and this process and
    everything it started (a compiler, inductor's compile workers) end once it has, or after
    UNWIND_SECONDS (a stage deep in a library's C code; the next build sweeps what it left). The
    caller waits for this end of the socket to close (cudabuild.engine.warm.hang_up)."""
    main = threading.main_thread().ident

    def wait():
        try:
            conn.recv(1)
        except OSError:
            pass
        _caller_left.set()
        if not _answered.is_set():
            with contextlib.suppress(OSError):
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(UNWIND_SECONDS)
        _end_group()

    threading.Thread(target=wait, daemon=True).start()


def _serve_call(conn: socket.socket) -> None:
    """In a forked child or a spare: take the caller's stdio, run its call, answer. Never returns."""
    try:
        message, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        if not message:
            os._exit(0)  # a caller that connected and left
        if len(message) < HEADER.size:
            message += exactly(conn, HEADER.size - len(message))
        size = HEADER.unpack(message)[0]
        call = pickle.loads(exactly(conn, size))
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(call["environ"])
        os.chdir(call["cwd"])
        sys.path[:] = call["path"]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A fork inherits the forking worker's ignored SIGCHLD, with which the kernel reaps the
        # call's own children at once and subprocess reads every exit status as 0 (a compiler
        # that failed would pass).
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            os.setpgid(0, 0)  # a group of its own: what the call starts ends with it
        except OSError:
            pass
        _exit_when_caller_leaves(conn)
        module, _, function = call["function"].partition(":")
        try:
            result = {"value": getattr(importlib.import_module(module), function)(call["payload"])}
        except BaseException as e:  # handed to the caller, which raises it there
            result = {"error": picklable(e), "traceback": traceback.format_exc()}
        _answered.set()
        if _caller_left.is_set():  # interrupted, and unwound: no one to answer
            _end_group()
        sys.stdout.flush()
        sys.stderr.flush()
        result["server"] = SERVER_PID
        send(conn, pickle.dumps(result))
    except BaseException:
        if _caller_left.is_set():  # the interrupt came between the call's end and its answer
            _end_group()
        traceback.print_exc()
        os._exit(2)
    os._exit(0)


def picklable(error: BaseException, otherwise=None):
    """The error, where it survives a trip through pickle (its class can be rebuilt from its
    args), else `otherwise`: what crosses the socket in its place."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return otherwise


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this file's folder (cudabuild/engine) is no import root
    if sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), _modules(sys.argv[5]))
    path, idle, modules, mode_file = sys.argv[1], float(sys.argv[2]), _modules(sys.argv[3]), sys.argv[4]
    # Each call takes its caller's directory; the server's own is one that outlives it (a build's
    # may be deleted before a worker started later is).
    os.chdir(os.path.dirname(os.path.abspath(path)))
    _serve(path, idle, modules, mode_file)


def _modules(listed: str) -> list[str]:
    return [m for m in listed.split(",") if m]


def default_spares() -> int:
    """One spare per two cores, SPARES_MIN to SPARES_MAX, and no more than the available memory
    holds at SPARE_BYTES each (but SPARES_MIN in any case)."""
    by_cores = (os.cpu_count() or 2) // 2
    by_memory = SPARES_MAX
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    by_memory = int(line.split()[1]) * 1024 // SPARE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    return max(SPARES_MIN, min(SPARES_MAX, by_cores, by_memory))


def remembered_mode(mode_file: str) -> str | None:
    """"spares" or "forks", as the toolchain's last server found within SPARES_DAYS, else None."""
    try:
        if time.time() - os.stat(mode_file).st_mtime >= SPARES_DAYS * 86400:
            return None
        with open(mode_file) as remembered:
            return "forks" if remembered.read().startswith("forks") else "spares"
    except OSError:
        return None


def nvidia_driver_loaded() -> bool:
    """Whether this machine's kernel has the NVIDIA driver (not whether a process initialised it:
    asking that would map the library into the server, which must stay clear of it)."""
    return os.path.exists("/proc/driver/nvidia/version")


class _Worker:
    """One worker process, and the socket it reports on: F (imported; forks for every call),
    R (imported; waits for one call), T (took its call). Its end of the socket closing tells it
    the server is gone; the server's end closing, that the worker is."""

    def __init__(self, listener: socket.socket, idle: float, modules: list[str]):
        self.channel, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(listener.fileno()), str(theirs.fileno()),
             str(idle), ",".join(modules)],
            stdin=subprocess.DEVNULL, pass_fds=(listener.fileno(), theirs.fileno()))
        theirs.close()
        self.state = "importing"

    def read(self) -> bool:
        """Take its reports; False once it is gone (its call served, idle, or died)."""
        try:
            data = self.channel.recv(16)
        except OSError:
            data = b""
        if not data:
            self.channel.close()
            self.process.wait()
            return False
        for report, state in ((b"F", "forking"), (b"R", "ready"), (b"T", "serving")):
            if report in data:
                self.state = state
        return True


def _serve(path: str, idle: float, modules: list[str], mode_file: str) -> None:
    try:
        spares = max(1, int(os.environ.get(SPARES_ENV) or default_spares()))
    except ValueError:
        spares = default_spares()
    temporary = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(temporary)
    listener.listen(64)
    remembered = remembered_mode(mode_file)
    mode = None  # None: one worker, until it says
    if remembered == "spares":
        mode = "spares"
        print(f"warm: starting {spares} spares at once, as {mode_file} says", flush=True)
    elif remembered is None and nvidia_driver_loaded():
        mode = "spares"
        print(f"warm: starting {spares} spares at once: the NVIDIA driver is loaded here", flush=True)
    workers: list[_Worker] = []
    mine, failures, last_call, decided = None, 0, time.monotonic(), False
    while mine is None or _still_mine(path, mine):
        wanted = {None: 1, "spares": spares, "forks": 0}[mode]
        while sum(w.state in ("importing", "ready") for w in workers) < wanted and failures < WORKER_FAILURES:
            workers.append(_Worker(listener, idle, modules))
        if not workers:
            print("warm: no worker left to serve (idle, or their imports kept failing): exiting", flush=True)
            break
        # Wake each second: a server whose socket was removed (`cudabuild warm stop`) goes promptly.
        readable, _, _ = select.select([w.channel for w in workers], [], [], 1.0)
        for worker in [w for w in workers if w.channel in readable]:
            was = worker.state
            if not worker.read():
                workers.remove(worker)
                failures += was == "importing"
                continue
            if worker.state == "serving":
                last_call = time.monotonic()
            elif worker.state != was:  # imported: F or R
                failures = 0
                said = "forks" if worker.state == "forking" else "spares"
                if decided and mode == "forks" and said == "forks":  # one forking worker is enough
                    worker.channel.close()
                    workers.remove(worker)
                elif not decided or mode == "spares" and said == "forks":
                    mode, decided = said, True
                    _remember(mode_file, mode)
                    print(f"warm: serving calls with {'forks of one worker' if mode == 'forks' else f'{spares} spares'}",
                          flush=True)
        if mine is None and any(w.state in ("ready", "forking") for w in workers):
            os.replace(temporary, path)  # callers see the socket only once a call finds the imports done
            mine = os.stat(path).st_ino
            print(f"warm: serving {path} (pid {os.getpid()})", flush=True)
        if mode == "spares" and time.monotonic() - last_call > idle and not any(w.state == "serving" for w in workers):
            print("warm: idle, exiting", flush=True)
            break
    for worker in workers:
        if worker.state != "serving":  # a call being served finishes; the waiting go
            worker.channel.close()  # a forking worker stops accepting, lets its children finish
            if worker.state != "forking":
                worker.process.terminate()
    try:
        if mine is None:
            os.unlink(temporary)
        elif _still_mine(path, mine):
            os.unlink(path)
    except OSError:
        pass


def _remember(mode_file: str, mode: str) -> None:
    try:
        with open(mode_file, "w") as remembered:
            remembered.write(f"{mode} {time.time()}")
    except OSError:
        pass  # only a hint for the next server


def _still_mine(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _worker(listener_fd: int, channel_fd: int, idle: float, modules: list[str]) -> None:
    """Import, then serve: by forking per call where the driver allows it, else one call. Never returns."""
    global SERVER_PID
    SERVER_PID = os.getppid()
    listener = socket.socket(fileno=listener_fd)
    channel = socket.socket(fileno=channel_fd)
    _preload(modules)
    initialised = device_driver_state() == "initialised"
    if not initialised and os.environ.get(MODE_ENV, "").strip().lower() != "spares":
        channel.sendall(b"F")
        _serve_with_forks(listener, channel, idle)
        os._exit(0)
    if initialised:
        print("warm: an import initialised the CUDA driver, which forked children could not use", flush=True)
    serving = threading.Event()

    def leave_with_the_server():
        try:
            channel.recv(1)
        except OSError:
            pass
        if not serving.is_set():
            os._exit(0)

    threading.Thread(target=leave_with_the_server, daemon=True).start()
    channel.sendall(b"R")
    conn, _ = listener.accept()
    serving.set()
    listener.close()
    try:
        channel.sendall(b"T")
    except OSError:
        pass  # the server is gone; the caller is not
    _serve_call(conn)


def _serve_with_forks(listener: socket.socket, channel: socket.socket, idle: float) -> None:
    """Fork a child per call until idle (no call for `idle` seconds, no child left) or until the
    server is gone (it closes the channel when its socket was taken or removed)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    last_call = time.monotonic()
    while True:
        readable, _, _ = select.select([listener, channel], [], [], 5.0)
        if channel in readable:
            return  # nothing else is ever sent on it: the server closed it
        if listener not in readable:
            if time.monotonic() - last_call > idle and not _has_children():
                print("warm: idle, exiting", flush=True)
                return
            continue
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            continue  # another process took it
        last_call = time.monotonic()
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            channel.close()
            _serve_call(conn)
        conn.close()


def device_driver_state() -> str:
    """"unmapped", "mapped, not initialised" or "initialised": whether an import called cuInit.
    Only that makes a fork unusable: torch's CUDA build maps libcuda.so when imported (found on
    the GPU machine, torch 2.11.0+cu130) without initialising it. The driver answers any call
    before cuInit with CUDA_ERROR_NOT_INITIALIZED, and asking cuDeviceGetCount initialises
    nothing, so it tells the two apart. (bench/gpu/driver_probe.py asks it after each import.)"""
    try:
        with open("/proc/self/maps") as maps:
            if not any("libcuda.so" in line for line in maps):
                return "unmapped"
    except OSError:
        return "unmapped"
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")  # the copy already mapped: dlopen returns its handle
        count = ctypes.c_int()
        if driver.cuDeviceGetCount(ctypes.byref(count)) == CUDA_ERROR_NOT_INITIALIZED:
            return "mapped, not initialised"
    except (OSError, AttributeError):
        pass  # mapped under another name, or not the driver we know: do not fork it
    return "initialised"


def _has_children() -> bool:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as children:
            return bool(children.read().strip())
    except OSError:
        return False


if __name__ == "__main__":
    main()

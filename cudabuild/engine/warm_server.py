"""The warm process itself: imports the heavy libraries once, then forks one child per call.

    python cudabuild/engine/warm_server.py SOCKET IDLE_SECONDS MODULE[,MODULE...]

Started by cudabuild.engine.warm (never by hand), detached from the build that started it. It
runs by path, not as part of the cudabuild package, and imports nothing of cudabuild: what it
imports stays in every child it forks, and the project's own code (models, recipes, cudabuild
itself) must be read from disk by each child, or an edit would not reach the next build. So it
imports only the listed third-party modules (a module that fails to import is skipped), then
listens on SOCKET.

A call is one connection. The server forks at once and goes back to listening; the child takes
the caller's stdin, stdout and stderr (passed over the socket), its environment, working
directory and sys.path, imports the named function and runs it on the payload, and sends back what
it returns (or the exception it raised). While it runs, a thread waits for the caller to hang up:
a caller that is gone (a build interrupted) ends the child, and so the stage it ran.

The server exits after IDLE_SECONDS without a call and with no child left, or as soon as SOCKET
is no longer its own (another server took the name), and removes the socket it made.
Standard library only, on purpose: see above. The caller's side (cudabuild.engine.warm) imports
this module for the framing (HEADER, send, receive) and the REFUSED exit status, so the two
agree by construction.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback

HEADER = struct.Struct("!Q")
# The exit status of a server that will not serve (its imports initialised the CUDA driver). It
# leaves SOCKET's name with the suffix .refused beside it, which the callers of its key read
# (cudabuild.engine.warm.WarmProcesses.refused_path) rather than start it again.
REFUSED = 4
CUDA_ERROR_NOT_INITIALIZED = 3


def receive(conn: socket.socket) -> bytes:
    size = HEADER.unpack(_exactly(conn, HEADER.size))[0]
    return _exactly(conn, size)


def _exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
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


def _exit_when_caller_leaves(conn: socket.socket) -> None:
    """The caller sends nothing after its call: the next recv returns only when it hangs up."""
    def wait():
        try:
            conn.recv(1)
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=wait, daemon=True).start()


def _serve_call(conn: socket.socket) -> None:
    """In the forked child: take the caller's stdio, run its call, answer. Never returns."""
    try:
        message, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        if not message:
            os._exit(0)  # a caller that connected and left
        if len(message) < HEADER.size:
            message += _exactly(conn, HEADER.size - len(message))
        size = HEADER.unpack(message)[0]
        call = pickle.loads(_exactly(conn, size))
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(call["environ"])
        os.chdir(call["cwd"])
        sys.path[:] = call["path"]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _exit_when_caller_leaves(conn)
        module, _, function = call["function"].partition(":")
        try:
            result = {"value": getattr(importlib.import_module(module), function)(call["payload"])}
        except BaseException as e:  # handed to the caller, which raises it there
            result = {"error": _picklable(e), "traceback": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        send(conn, pickle.dumps(result))
    except BaseException:
        traceback.print_exc()
        os._exit(2)
    os._exit(0)


def _picklable(error: BaseException):
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return None


def main() -> None:
    path, idle, modules = sys.argv[1], float(sys.argv[2]), [m for m in sys.argv[3].split(",") if m]
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this file's folder (cudabuild/engine) is no import root
    _preload(modules)
    if device_driver_state() == "initialised":
        # A CUDA driver initialised before fork cannot be used by the children (nor re-initialised).
        print("warm: an import initialised the CUDA driver, which forked children could not use: not serving",
              flush=True)
        with open(os.path.splitext(path)[0] + ".refused", "w") as refused:  # read by the callers of this key
            refused.write(str(time.time()))
        sys.exit(REFUSED)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    temporary = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(temporary)
    listener.listen(64)
    os.replace(temporary, path)  # callers see the socket only once the imports are done
    mine = os.stat(path).st_ino
    listener.settimeout(5.0)
    last_call = time.monotonic()
    print(f"warm: serving {path} (pid {os.getpid()})", flush=True)
    while True:
        try:
            if os.stat(path).st_ino != mine:
                return  # replaced: the newer server owns the name
        except OSError:
            return
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            if time.monotonic() - last_call > idle and not _has_children():
                break
            continue
        last_call = time.monotonic()
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            _serve_call(conn)
        conn.close()
    print("warm: idle, exiting", flush=True)
    try:
        if os.stat(path).st_ino == mine:
            os.unlink(path)
    except OSError:
        pass


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

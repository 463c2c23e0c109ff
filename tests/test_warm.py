"""Warm processes (cudabuild.engine.warm): a call runs in a fork of a server that imported its
modules already, with the caller's environment, directory, sys.path and terminal, and reads the
project's code from disk each time; a stage that runs there gives the build it gives here.

The engine tests start real servers with nothing to import (they come up at once); the build
test starts one that imports torch and ExecuTorch, as a build does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cudabuild.engine import warm, warm_server
from _faults import forget
from conftest import assert_ok

CALLS = '''
import os, sys, time
from pathlib import Path

def answer(payload):
    return {"value": payload * 2, "pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(),
            "flag": os.environ.get("WARM_TEST_FLAG"), "path0": sys.path[0],
            "driver": "libcuda.so" in Path("/proc/self/maps").read_text()}

def version(payload):
    return VERSION

def fails(payload):
    raise KeyError(payload)

def prints(payload):
    print("from the child", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return True

def sleeps(payload):
    Path(payload).write_text(str(os.getpid()))
    time.sleep(120)

def exits(payload):
    import subprocess
    return subprocess.run(["sh", "-c", f"exit {payload}"]).returncode

def starts_a_program(payload):
    import subprocess
    program = subprocess.Popen(["sleep", "120"])
    Path(payload + ".tmp").write_text(f"{os.getpid()} {program.pid}")
    Path(payload + ".tmp").rename(payload)
    program.wait()

def works_in_a_folder(payload):
    import subprocess
    from cudabuild.engine.store import Store
    with Store(payload["cache"]).objects.work_folder("compile.decode") as work:
        (work / "model.so").write_bytes(b"half a .so")
        program = subprocess.Popen(["sleep", "120"])
        Path(payload["pids"] + ".tmp").write_text(f"{os.getpid()} {program.pid} {work}")
        Path(payload["pids"] + ".tmp").rename(payload["pids"])
        program.wait()
'''


@pytest.fixture
def calls(tmp_path, monkeypatch):
    """A module of functions to call, importable by the caller's sys.path (which the child takes),
    and a warm process of its own cache, stopped afterwards."""
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "warm_calls.py").write_text(CALLS.replace("return VERSION", "return 1"))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv(warm.IDLE_ENV, "60")
    processes = warm.WarmProcesses(tmp_path / "cache", ())
    yield processes, folder
    for process in warm.running():
        if process["cache"] == str((tmp_path / "cache").resolve()):
            warm.stop(process)


def test_a_call_runs_in_a_fork_of_one_server_with_the_callers_environment(calls, tmp_path, monkeypatch):
    processes, folder = calls
    monkeypatch.setenv("WARM_TEST_FLAG", "first")
    monkeypatch.chdir(tmp_path)
    one = processes.call("warm_calls:answer", 21)
    server = processes.last_server
    assert one["value"] == 42
    assert one["pid"] != os.getpid() and server not in (None, os.getpid())
    assert one["cwd"] == str(tmp_path) and one["flag"] == "first" and one["path0"] == str(folder)
    # A variable no library reads at import time: the same server, the same worker forked again,
    # the new value.
    monkeypatch.setenv("WARM_TEST_FLAG", "second")
    two = processes.call("warm_calls:answer", 1)
    assert processes.last_server == server and two["parent"] == one["parent"]
    assert two["pid"] != one["pid"] and two["flag"] == "second"
    listed = [p for p in warm.running() if p["cache"] == str((tmp_path / "cache").resolve())]
    assert [p["pid"] for p in listed] == [server]
    # One that a library may read when imported: another server (for a caller keyed after it).
    monkeypatch.setenv("TORCHINDUCTOR_WARM_TEST", "1")
    processes.call("warm_calls:answer", 1)
    assert processes.last_server == server
    other = warm.WarmProcesses(tmp_path / "cache", ())
    other.call("warm_calls:answer", 1)
    assert other.last_server != server


def test_the_projects_code_is_read_again_by_every_call(calls):
    processes, folder = calls
    assert processes.call("warm_calls:version", None) == 1
    source = folder / "warm_calls.py"
    # A new size as well as new bytes: CPython trusts a .pyc whose source has the same size and the
    # same mtime in whole seconds, and this edit comes within a second of the import that wrote it
    # (in any Python process, warm or not; with PYTHONDONTWRITEBYTECODE unset, as on a fresh machine).
    source.write_text(source.read_text().replace("return 1", "return 22"))
    assert processes.call("warm_calls:version", None) == 22


def test_an_error_is_raised_in_the_caller_and_output_reaches_its_terminal(calls, capfd):
    processes, _ = calls
    with pytest.raises(KeyError, match="missing"):
        processes.call("warm_calls:fails", "missing")
    assert processes.call("warm_calls:prints", None) is True
    printed = capfd.readouterr()
    assert "from the child" in printed.out and "to stderr" in printed.err


def test_a_caller_that_is_killed_takes_its_call_with_it(calls, tmp_path):
    processes, folder = calls
    pid_file = tmp_path / "child.pid"
    script = (f"import sys; sys.path.insert(0, {str(folder)!r}); from cudabuild.engine import warm; "
              f"warm.WarmProcesses({str(tmp_path / 'cache')!r}, ()).call('warm_calls:sleeps', {str(pid_file)!r})")
    caller = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.monotonic() + 600
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 600
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the call outlived its caller"


def test_a_calls_programs_report_their_exit_status(calls):
    """The forking worker ignores SIGCHLD (the kernel reaps its children); a call's process must not
    inherit that, or every program it runs would read as having exited 0."""
    processes, _ = calls
    assert processes.call("warm_calls:exits", 3) == 3


def test_an_interrupted_caller_ends_the_call_and_what_it_started_before_it_returns(calls, tmp_path):
    """Ctrl-C in the caller while its call runs a program: by the time the caller has returned, the
    call's process and the program are gone (a compiler must not outlive an interrupted build)."""
    processes, folder = calls
    pid_file = tmp_path / "pids"
    # The handler set explicitly: a caller that inherited SIGINT ignored would not see the Ctrl-C at all.
    script = (f"import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              f"sys.path.insert(0, {str(folder)!r}); from cudabuild.engine import warm\n"
              f"try: warm.WarmProcesses({str(tmp_path / 'cache')!r}, ()).call('warm_calls:starts_a_program', "
              f"{str(pid_file)!r})\nexcept KeyboardInterrupt: sys.exit(130)")
    caller = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.monotonic() + 600
    while not pid_file.exists() and caller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child, program = map(int, pid_file.read_text().split())
    assert _alive(child) and _alive(program)
    caller.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert caller.wait(timeout=600) == 130, f"the caller returned {time.monotonic() - sent:.1f} s after the SIGINT"
    assert not _alive(child) and not _alive(program)


def test_an_interrupted_call_unwinds_and_its_stage_removes_its_work_folder(calls, tmp_path):
    """Ctrl-C in a build whose stage runs in a warm process: the call is interrupted as a stage in
    the build's own process is, so its work folder is removed as it unwinds (issue 59: the call's
    process was killed outright, and `work/<stage>-<pid>-*` folders outlived the build), and then
    it and the program it started end, before the caller returns."""
    processes, folder = calls
    pid_file = tmp_path / "pids"
    payload = {"cache": str(tmp_path / "stage-cache"), "pids": str(pid_file)}
    script = (f"import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              f"sys.path.insert(0, {str(folder)!r}); from cudabuild.engine import warm\n"
              f"try: warm.WarmProcesses({str(tmp_path / 'cache')!r}, ()).call('warm_calls:works_in_a_folder', "
              f"{payload!r})\nexcept KeyboardInterrupt: sys.exit(130)")
    caller = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.monotonic() + 600
    while not pid_file.exists() and caller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child, program, work = pid_file.read_text().split()
    assert Path(work, "model.so").exists() and _alive(int(program))
    caller.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert caller.wait(timeout=600) == 130
    waited = time.monotonic() - sent
    assert not _alive(int(child)) and not _alive(int(program))
    assert not Path(work).exists(), "the interrupted stage left its work folder"
    assert waited < warm_server.UNWIND_SECONDS, f"the call took {waited:.1f} s to unwind"


def test_an_idle_server_exits_and_a_stopped_one_goes(tmp_path, monkeypatch, calls):
    processes, _ = calls
    monkeypatch.setenv(warm.IDLE_ENV, "1")
    short = warm.WarmProcesses(tmp_path / "short", ())
    worker = short.call("warm_calls:answer", 0)["parent"]
    server = short.last_server
    deadline = time.monotonic() + 600
    while (_alive(server) or _alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(server) and not _alive(worker) and not short.socket_path().exists()
    monkeypatch.setenv(warm.IDLE_ENV, "600")
    worker = processes.call("warm_calls:answer", 0)["parent"]
    server = processes.last_server
    for process in warm.running():
        if process["pid"] == server:
            warm.stop(process)
    deadline = time.monotonic() + 600
    while (_alive(server) or _alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(server) and not _alive(worker)


# A library in the CUDA driver's place (its soname, its cuDeviceGetCount) that answers as the real
# one does before cuInit (3, CUDA_ERROR_NOT_INITIALIZED) or after it (0): what the warm server
# reads to decide between forks and spares. CPU machines have no driver to load.
DRIVER_SOURCE = "int cuDeviceGetCount(int *count) { *count = 1; return STATUS; }\n"
LOADS_DRIVER = "import ctypes\nctypes.CDLL({library!r})\n"


def _driver_loading_module(folder: Path, status: int) -> str:
    """A module that maps a stand-in driver answering `status` when imported; its name."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "driver.c"
    source.write_text(DRIVER_SOURCE.replace("STATUS", str(status)))
    library = folder / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)], check=True)
    (folder / f"loads_driver_{status}.py").write_text(LOADS_DRIVER.format(library=str(library)))
    return f"loads_driver_{status}"


def test_where_the_imports_initialised_the_driver_each_call_gets_a_spare(calls, tmp_path, monkeypatch):
    _, folder = calls
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "driver"), str(folder)]))
    monkeypatch.setenv(warm_server.SPARES_ENV, "2")
    # Mapped but not initialised (torch's CUDA build, once imported): calls are forks of one
    # worker, which imported; the server imported nothing.
    mapped = warm.WarmProcesses(tmp_path / "cache", (_driver_loading_module(tmp_path / "driver", 3),))
    forked = [mapped.call("warm_calls:answer", n) for n in (1, 2)]
    assert [a["value"] for a in forked] == [2, 4] and forked[0]["parent"] == forked[1]["parent"]
    assert _maps_driver(forked[0]["parent"]) and not _maps_driver(mapped.last_server)
    assert "forks of one worker" in mapped.log_path().read_text()
    # Noted too: where the NVIDIA driver is loaded, a server of this toolchain will not start
    # spares at once on the guess that its imports initialise it.
    assert _mode_file(mapped).read_text().startswith("forks")
    # Initialised (inductor's import calls cuInit on a GPU machine): each call is served by a spare,
    # a child of the server that imported, then took that one call.
    initialised = warm.WarmProcesses(tmp_path / "cache", (_driver_loading_module(tmp_path / "driver", 0),))
    # The mode file lives beside every server of this user and outlives a test run: an earlier
    # run's would have this server start its spares at once.
    _mode_file(initialised).unlink(missing_ok=True)
    answers = [initialised.call("warm_calls:answer", n) for n in range(3)]
    server = initialised.last_server
    assert [a["value"] for a in answers] == [0, 2, 4] and len({a["pid"] for a in answers}) == 3
    assert {a["parent"] for a in answers} == {server} and all(a["driver"] for a in answers)
    assert not _maps_driver(server)
    log = initialised.log_path().read_text()
    assert log.count("serving calls with 2 spares") == 1
    # Each spare that took a call was replaced: two wait again.
    deadline = time.monotonic() + 600
    while len(_children(server)) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_children(server)) == 2
    # The toolchain's mode is noted: its next server starts both spares at once, not one to ask.
    assert _mode_file(initialised).exists()
    _stop(initialised, server)
    assert all(not _alive(int(pid)) for pid in _children(server))
    initialised.call("warm_calls:answer", 1)
    assert initialised.last_server != server
    deadline = time.monotonic() + 600
    while len(_children(initialised.last_server)) != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_children(initialised.last_server)) == 2
    assert initialised.log_path().read_text().count("spares at once") == 1
    _stop(initialised, None)
    # A week-old server's files, its socket gone, are removed when another server starts.
    stale_log = warm.folder() / "0123456789abcdef01234567.log"
    stale_log.write_text("warm: idle, exiting\n")
    week_ago = time.time() - warm.STALE_DAYS * 86400 - 60
    os.utime(stale_log, (week_ago, week_ago))
    assert initialised.call("warm_calls:answer", 1)["value"] == 2
    assert not stale_log.exists()


def _mode_file(processes: warm.WarmProcesses) -> Path:
    return processes.mode_file


def _maps_driver(pid: int) -> bool:
    return "libcuda.so" in Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def _stop(processes: warm.WarmProcesses, pid) -> None:
    """Stop this key's server and wait until it is gone."""
    for process in warm.running():
        if process["socket"] == str(processes.socket_path()):
            pid = process["pid"]
            warm.stop(process)
    deadline = time.monotonic() + 600
    while pid is not None and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid is None or not _alive(pid)


def test_a_mode_file_says_spares_or_forks_for_a_week_and_old_ones_still_read(tmp_path):
    mode_file = str(tmp_path / "toolchain.mode")
    assert warm_server.remembered_mode(mode_file) is None  # none yet: the first worker will say
    warm_server._remember(mode_file, "forks")
    assert warm_server.remembered_mode(mode_file) == "forks"
    warm_server._remember(mode_file, "spares")
    assert warm_server.remembered_mode(mode_file) == "spares"
    Path(mode_file).write_text(str(time.time()))  # the format before forks were noted: only spares were
    assert warm_server.remembered_mode(mode_file) == "spares"
    stale = time.time() - warm_server.SPARES_DAYS * 86400 - 60
    os.utime(mode_file, (stale, stale))
    assert warm_server.remembered_mode(mode_file) is None


def test_the_default_spares_follow_the_cores_within_bounds():
    spares = warm_server.default_spares()
    assert warm_server.SPARES_MIN <= spares <= warm_server.SPARES_MAX
    assert spares <= max(warm_server.SPARES_MIN, (os.cpu_count() or 2) // 2)


def test_off_by_switch_and_by_default_only_where_asked(monkeypatch):
    assert warm.enabled(default=True, environ={}) and not warm.enabled(default=False, environ={})
    assert warm.enabled(default=False, environ={warm.ENV: "1"})
    assert not warm.enabled(default=True, environ={warm.ENV: "0"})


@pytest.mark.slow
def test_a_stage_run_warm_is_the_stage_run_here(tiny_copy, tmp_path):
    """A build of one worker finds no warm process: it runs its stages itself and starts one for
    the next build as it ends. The next build's compile runs in that server's child, with its
    phases in the timeline, and gives the bytes a build without warm processes gives; so does one
    run in a spare."""
    cold = tiny_copy.copy(tmp_path / "without")
    warm_env = tiny_copy.env(CUDABUILD_WARM=1, CUDABUILD_WARM_IDLE_SECONDS=60)
    first, second = "decode.emulate_precision_casts=OFF", "decode.compile_wrapper_opt_level=O0"
    try:
        assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu", first, env=warm_env))
        assert tiny_copy.statuses()["compile.decode"] == "ran"
        assert "warm" not in _compile_decode(tiny_copy)[0]["args"]
        server = _wait_for_server(tiny_copy)
        assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu", second, env=warm_env))
        assert tiny_copy.stamp("compile.decode")["status"] == "ran"
        compile_span, inside = _compile_decode(tiny_copy)
        assert compile_span["args"]["warm"] == server
        assert {"run", "AOTInductor"} <= set(inside)
        # Torch was imported before the fork: the stage's own imports are the project's modules
        # (an `import` phase is kept from 0.05 s). Without warm processes it imports torch itself.
        assert_ok(cold.export("model=tiny_lm", "target=cpu", second))
        assert inside.get("import", 0.0) < 1.0 <= _compile_decode(cold)[1]["import"], (inside, _compile_decode(cold)[1])
        assert tiny_copy.manifest()["outputs"] == cold.manifest()["outputs"]
        # Spare mode (what the GPU machine gets, asked for here): a build of two workers starts
        # the server at its first stage that must run, which then runs in a spare that had
        # imported torch, and gives the same bytes. (The compile forgotten, so that it runs again.)
        forget(tiny_copy, "compile.decode")
        # (Three spares said outright: the default follows the cores, and this test the log line.)
        spares_env = dict(warm_env, CUDABUILD_WARM_MODE="spares", CUDABUILD_WARM_SPARES="3")
        assert_ok(tiny_copy.doit("-n", "2", "export", "model=tiny_lm", "target=cpu", second, env=spares_env))
        assert tiny_copy.stamp("compile.decode")["status"] == "ran"
        compile_span, inside = _compile_decode(tiny_copy)
        assert compile_span["args"]["warm"] not in (None, server)
        assert inside.get("import", 0.0) < 1.0, inside
        assert "3 spares" in "".join(p.read_text() for p in warm.folder().glob("*.log")
                                       if f"pid {compile_span['args']['warm']})" in p.read_text())
        assert tiny_copy.manifest()["outputs"] == cold.manifest()["outputs"]
    finally:
        tiny_copy.cudabuild("warm", "stop", CUDABUILD_WARM="1")
    assert "no warm process" in tiny_copy.cudabuild("warm").stdout


@pytest.mark.slow
def test_a_stage_run_warm_that_finds_an_upstream_blob_bad_has_its_producer_rewound(built_tiny, tiny_copy):
    """The warm process's child builds no runner (cudabuild.engine.far_end), so it cannot run a
    stage's producer: the bad upstream blob it finds comes back as LostInput, and the build's runner
    rewinds the producer (in the warm process too) and runs the stage again; the build gives the
    bytes of a clean one."""
    from _faults import assert_same_outputs, blob_file, forget

    blob = tiny_copy.stamp("export.decode")["outputs"]["program.json"]
    path = blob_file(tiny_copy, blob)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    forget(tiny_copy, "edge.decode")  # edge reads export's program
    # Two workers: the build starts the warm process at its first stage that must run.
    env = tiny_copy.env(CUDABUILD_WARM=1, CUDABUILD_JOBS=2, CUDABUILD_WARM_IDLE_SECONDS=60)
    try:
        result = tiny_copy.export("model=tiny_lm", "target=cpu", env=env)
        assert_ok(result)
        statuses = tiny_copy.statuses()
        assert statuses["export.decode"] == statuses["edge.decode"] == "ran", statuses
        assert f"cudabuild: warning: cached blob {blob[:12]}" in result.stderr and "failed its sha256 check" in result.stderr
        assert "export.decode: a cached output was missing or corrupt; running it again" in result.stdout + result.stderr
        events = json.loads((tiny_copy.build_dir / "trace.json").read_text())["traceEvents"]
        edge = [e for e in events if e["name"] == "edge.decode" and e["args"].get("step") == "execute"]
        assert edge and all(e["args"].get("warm") for e in edge), edge  # run in the warm process
        assert_same_outputs(tiny_copy, built_tiny)
    finally:
        tiny_copy.cudabuild("warm", "stop", CUDABUILD_WARM="1")


def _wait_for_server(project, seconds: float = 120.0) -> int:
    """The pid of the project's cache's warm process, once it serves (it imports torch first)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        listed = project.cudabuild("warm").stdout
        if listed.startswith("pid ") and "starting (importing)" not in listed.splitlines()[0]:
            return int(listed.split()[1])
        time.sleep(0.5)
    raise AssertionError(f"no warm process served within {seconds} s: {listed}")


def _compile_decode(project) -> tuple[dict, dict[str, float]]:
    """The last build's compile.decode span, and the seconds of each phase recorded inside it."""
    events = json.loads((project.build_dir / "trace.json").read_text())["traceEvents"]
    span = next(e for e in events if e["name"] == "compile.decode" and e["args"].get("step") == "execute")
    inside: dict[str, float] = {}
    for e in events:
        if e["pid"] == span["pid"] and span["ts"] <= e["ts"] <= span["ts"] + span["dur"] and e is not span:
            inside[e["name"]] = inside.get(e["name"], 0.0) + e.get("dur", 0) / 1e6
    return span, inside


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _cudabuild(tmp_path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDABUILD_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).parent.parent))
    return subprocess.run([sys.executable, "-m", "cudabuild", *args], env=env, capture_output=True, text=True, timeout=600)


def test_warm_lists_this_caches_processes_and_stop_says_so_once_they_are_gone(calls, tmp_path):
    processes, _ = calls
    processes.call("warm_calls:answer", 1)
    server = processes.last_server
    listed = _cudabuild(tmp_path, "warm").stdout.splitlines()
    assert listed[0].startswith(f"pid {server}  ") and " MB resident  cache " in listed[0]
    assert listed[-1].startswith("1 warm process of this cache") and "--all lists every cache's" in listed[-1]
    stopped = _cudabuild(tmp_path, "warm", "stop")
    assert stopped.stdout.startswith("stopped 1 warm process of this cache")
    assert not _alive(server)  # gone when the command says so, not seconds later


def test_stop_ends_a_warm_process_still_importing(tmp_path, monkeypatch):
    # A build of one worker starts its warm process as it ends: for several seconds it imports and
    # has no socket yet. `warm stop` must end that one too, not leave it up for 15 minutes.
    slow = tmp_path / "mods"
    slow.mkdir()
    (slow / "slow_import.py").write_text("import time\ntime.sleep(120)\n")
    monkeypatch.syspath_prepend(str(slow))
    monkeypatch.setenv("PYTHONPATH", str(slow))
    processes = warm.WarmProcesses(tmp_path / "cache", ("slow_import",))
    assert processes.start_in_background()
    mine = [p for p in warm.running() if p["cache"] == str((tmp_path / "cache").resolve())]
    assert len(mine) == 1 and mine[0]["starting"]
    stopped = _cudabuild(tmp_path, "warm", "stop")
    assert stopped.stdout.startswith("stopped 1 warm process of this cache")
    assert not _alive(mine[0]["pid"])

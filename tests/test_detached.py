"""cudabuild/detached.py: `cudabuild start/status/wait`, a build that outlives its command, and a build
killed mid-compile (SIGKILL of its whole process group) that resumes with only its unfinished stages;
`status` says what the detached build itself ran (not what a later build of the folder did), and
`status`/`wait` find the build of exactly their settings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_ok
from cudabuild import detached

SETTINGS = ("model=tiny_lm", "target=cpu")
O0 = "decode.compile_wrapper_opt_level=O0"  # a spec change: decode's compile and verify, and package, run again


def _alive_in_group(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split(None, 1)[0] == str(pgid)]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_detached_build_finishes_after_its_command_returned_and_one_killed_mid_compile_resumes(tiny_copy, tmp_path):
    """A detached build outlives its command and `wait` returns its status; the same build killed
    mid-compile (SIGKILL of its process group) is resumed by the next start with only its unfinished
    stages, and gives the bytes of the build that was not killed."""
    killed = tiny_copy.copy(tmp_path / "killed")  # the same change, to be killed mid-compile
    started = tiny_copy.cudabuild("start", *SETTINGS, O0)
    assert "started: pid" in started.stdout
    record = json.loads((tiny_copy.build_dir / "detached.json").read_text())
    again = tiny_copy.cudabuild("start", *SETTINGS, O0)  # one build per build directory at a time
    assert "already running" in again.stdout and f"pid {record['pid']}" in again.stdout
    waited = tiny_copy.cudabuild("wait", *SETTINGS, O0, "--timeout", "900")
    assert waited.stdout.startswith("done after"), waited.stdout
    assert tiny_copy.statuses()["compile.decode"] == "ran"
    assert json.loads((tiny_copy.build_dir / "detached.json").read_text())["rc"] == 0
    assert "verify" in (tiny_copy.build_dir / "detached.log").read_text()

    # (The copy holds the logs of the build it was copied from: the compile's is written again when it runs.)
    log = killed.build_dir / "logs" / "compile.decode.log"
    before = log.stat().st_mtime_ns
    killed.cudabuild("start", *SETTINGS, O0)
    record = json.loads((killed.build_dir / "detached.json").read_text())
    _wait_for(lambda: log.exists() and log.stat().st_mtime_ns > before, 600, "the compile to start")
    os.killpg(record["pid"], signal.SIGKILL)
    _wait_for(lambda: not _alive_in_group(record["pid"]), 30, "the build's processes to end")
    assert killed.cudabuild("status", *SETTINGS, O0).stdout.startswith("died")
    finished = {p.stem: p.stat().st_mtime_ns for p in (killed.build_dir / ".stamps").glob("*.json")}

    killed.cudabuild("start", *SETTINGS, O0)
    assert killed.cudabuild("wait", *SETTINGS, O0, "--timeout", "900", check=False).returncode == 0
    statuses = killed.statuses()
    assert statuses["compile.decode"] == "ran" and statuses["package"] == "ran"
    # What the killed build had finished was not done again: those stamps are untouched.
    now = {p.stem: p.stat().st_mtime_ns for p in (killed.build_dir / ".stamps").glob("*.json")}
    kept = [stage for stage, mtime in finished.items() if now.get(stage) == mtime]
    assert {"probe", "trace.decode", "trace.prefill", "export.decode", "export.prefill", "edge.decode",
            "edge.prefill"} <= set(kept), kept
    assert all(statuses[stage] == "cached" for stage in kept if stage in statuses)
    assert killed.manifest()["outputs"] == tiny_copy.manifest()["outputs"]


@pytest.mark.slow
def test_status_after_a_detached_no_op_says_nothing_needed_building_even_after_a_later_build(tiny_copy):
    tiny_copy.cudabuild("start", *SETTINGS)  # the copy is built: every stage up to date
    assert tiny_copy.cudabuild("wait", *SETTINGS, "--timeout", "600", check=False).returncode == 0
    status = tiny_copy.cudabuild("status", *SETTINGS).stdout.splitlines()
    assert status[0].startswith("done after")
    assert status[1] == "nothing needed building: every stage was up to date"
    # A later build in the foreground restores every stage (newer stamps than the no-op's start):
    # they are that build's, not the no-op's.
    for path in tiny_copy.build_dir.iterdir():
        if path.name not in (detached.RECORD, detached.LOG):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert_ok(tiny_copy.export(*SETTINGS))
    assert set(tiny_copy.statuses().values()) == {"restored"}
    assert tiny_copy.cudabuild("status", *SETTINGS).stdout.splitlines()[1] == "nothing needed building: every stage was up to date"


def _stamp(build_dir, stage: str, run: str, status: str = "ran") -> None:
    (build_dir / ".stamps").mkdir(parents=True, exist_ok=True)
    (build_dir / ".stamps" / f"{stage}.json").write_text(json.dumps({"key": "k", "inputs": {}, "digest": "d", "outputs": {},
                                                                      "status": status, "run": run}))


def _passes_for_a_keeper(seconds: int) -> subprocess.Popen:
    """A process whose command line names cudabuild.detached (what `alive` asks of a keeper), once it does."""
    process = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})", "cudabuild.detached"])
    _wait_for(lambda: detached.alive({"pid": process.pid}), 30, "the process to start")
    return process


def test_the_keeper_gives_its_build_a_run_id_and_keeps_the_stages_that_run_wrote(tmp_path):
    """The keeper runs its command with $CUDABUILD_RUN_ID (the doit build takes it for its RUN_ID);
    once the command ended, the record lists the stamps written under that id, and a later build
    that rewrites a stamp does not change it."""
    build_dir = tmp_path / "build" / "m" / "cpu"
    _stamp(build_dir, "probe", "an-earlier-build", "ran")  # an older stamp, not this build's
    writes = ("import json, os, sys; d = sys.argv[1] + '/.stamps/'; run = os.environ['CUDABUILD_RUN_ID']; "
              "[open(d + s + '.json', 'w').write(json.dumps({'status': st, 'run': run})) "
              "for s, st in (('export.decode', 'ran'), ('edge.decode', 'restored'))]")
    about = {"settings": ["model=m"], "build": None, "run": "0123456789abcdef0123456789abcdef"}
    keeper = subprocess.run([sys.executable, "-m", "cudabuild.detached", str(build_dir), json.dumps(about), "--",
                             sys.executable, "-c", writes, str(build_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert keeper.returncode == 0, keeper.stderr
    record = detached.read(build_dir)
    assert record["rc"] == 0 and record["stages"] == {"export.decode": "ran", "edge.decode": "restored"}
    _stamp(build_dir, "export.decode", "a-later-build", "restored")  # a foreground build of the folder, later
    assert detached.describe(build_dir)[1] == "stages it ran or restored: edge.decode (restored), export.decode"


def test_status_while_it_runs_lists_the_stamps_of_its_run_only(tmp_path):
    build_dir = tmp_path / "build"
    sleeper = _passes_for_a_keeper(60)
    try:
        record = {"argv": ["doit", "export"], "pid": sleeper.pid, "started": time.time() - 5, "run": "R"}
        build_dir.mkdir()
        (build_dir / detached.RECORD).write_text(json.dumps(record))
        _stamp(build_dir, "probe", "another build")  # newer than the start, but not this build's
        assert detached.describe(build_dir)[1] == "stages it ran or restored: none yet"
        _stamp(build_dir, "export.prefill", "R")
        assert detached.describe(build_dir)[1] == "stages it ran or restored: export.prefill"
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.fixture
def recorded(project):
    """The project with the record of a detached tiny_lm build of the default options (layers=2),
    as its keeper writes it, and a process that passes for that keeper, running."""
    from cudabuild.config import load_config
    from cudabuild.engine.store import Store

    store = Store(project.cache)
    config = load_config(project.root, {"model": "tiny_lm", "target": "cpu"}, store)
    store.close()
    keeper = _passes_for_a_keeper(120)
    record = {"argv": ["doit", "export", *SETTINGS], "settings": list(SETTINGS), "pid": keeper.pid, "started": time.time(),
              "run": "0" * 32, "build": detached.build_of(config.model, config.target, config.options, config.specs)}
    project.build_dir.mkdir(parents=True)
    (project.build_dir / detached.RECORD).write_text(json.dumps(record))
    yield project, keeper
    keeper.kill()
    keeper.wait()


def test_status_and_wait_find_the_build_of_exactly_their_settings(recorded):
    project, keeper = recorded
    for command in (["status"], ["wait", "--timeout", "0"]):
        other = project.cudabuild(*command, *SETTINGS, "layers=3", check=False)
        assert other.returncode == 2 and other.stdout == "", other.stderr
        assert other.stderr == (f"cudabuild: error: no detached build of model=tiny_lm target=cpu layers=3 in {project.build_dir}: "
                                "the one there is of layers=2 (`cudabuild status model=tiny_lm target=cpu` shows it); "
                                "`cudabuild start model=tiny_lm target=cpu layers=3` starts one\n")
    # The same build named by its default, or by the same values: found.
    for settings in (SETTINGS, (*SETTINGS, "layers=2", "seed=0")):
        assert project.cudabuild("status", *settings).stdout.startswith(f"running since ")
        waited = project.cudabuild("wait", *settings, "--timeout", "0", check=False)
        assert waited.returncode == 124 and waited.stderr == "still running after 0 s\n"
    spec = project.cudabuild("status", *SETTINGS, "decode.compile_wrapper_opt_level=O0", check=False)
    assert spec.returncode == 2 and "the one there is of decode.compile_wrapper_opt_level=(default) (" in spec.stderr


def test_a_start_of_other_settings_while_one_runs_in_the_folder_is_refused(recorded):
    project, keeper = recorded
    again = project.cudabuild("start", *SETTINGS)
    assert again.stdout.startswith(f"already running: pid {keeper.pid}")
    other = project.cudabuild("start", *SETTINGS, "layers=3", check=False)
    assert other.returncode == 2 and other.stdout == ""
    assert other.stderr == (f"cudabuild: error: a detached build of layers=2 runs in {project.build_dir} (pid {keeper.pid}), "
                            "the folder this build would write; `cudabuild wait model=tiny_lm target=cpu` waits for it; "
                            "then start this one\n")
    assert json.loads((project.build_dir / detached.RECORD).read_text())["pid"] == keeper.pid  # nothing started

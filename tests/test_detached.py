"""cudabuild/detached.py: `cudabuild start/status/wait`, a build that outlives its command, and a build
killed mid-compile (SIGKILL of its whole process group) that resumes with only its unfinished stages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import assert_ok

pytestmark = pytest.mark.slow
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


def test_status_after_a_detached_no_op_says_nothing_needed_building(tiny_copy):
    tiny_copy.cudabuild("start", *SETTINGS)  # the copy is built: every stage up to date
    assert tiny_copy.cudabuild("wait", *SETTINGS, "--timeout", "600", check=False).returncode == 0
    status = tiny_copy.cudabuild("status", *SETTINGS).stdout.splitlines()
    assert status[0].startswith("done after")
    assert status[1] == "nothing needed building: every stage was up to date"

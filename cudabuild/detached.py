"""A build that outlives the command that starts it: `cudabuild start`, `cudabuild status`, `cudabuild wait`.

    cudabuild start model=qwen_moe target=cuda size=35b-a3b     # returns at once
    cudabuild status model=qwen_moe target=cuda size=35b-a3b    # running / done / failed, stages done, log tail
    cudabuild wait model=qwen_moe target=cuda size=35b-a3b --timeout 540   # its exit status, or 124 still running

A full-size build takes longer than a command may last on a machine lent for minutes (a device
call ends and takes its processes with it, unless they started a session of their own). `start`
runs `python -m doit export SETTINGS` in a new session, in a small keeper process of this module
that writes the build's exit status when it ends; the build's output goes to
build/<model>/<target>/detached.log, and build/<model>/<target>/detached.json says what runs:
{argv, keeper pid, started, and once it ended: rc, ended}. A second `start` while it runs says
so and starts nothing. A build that died (killed, the machine taken back) leaves its finished
stages in the cache: `start` again resumes it, and only the unfinished stages run.

Owns the keeper and its record; knows nothing of stages beyond reading their stamps' names for
`status`. No torch here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from cudabuild.engine.files import atomic_write_text

RECORD, LOG = "detached.json", "detached.log"


def read(build_dir: Path) -> Optional[dict]:
    try:
        return json.loads((build_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None


def alive(record: Optional[dict]) -> bool:
    """Whether the record's keeper still runs (and is the keeper: a reused pid is not)."""
    if not record or "rc" in record:
        return False
    try:
        with open(f"/proc/{record['pid']}/cmdline", "rb") as f:
            return b"cudabuild.detached" in f.read()
    except OSError:
        return False


def start(build_dir: Path, project: Path, settings: list[str], env: Optional[dict] = None) -> tuple[dict, bool]:
    """Start the build detached, unless one runs for this build directory: (its record, started now)."""
    record = read(build_dir)
    if alive(record):
        return record, False
    build_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "doit", "export", *settings]
    keeper = [sys.executable, "-m", "cudabuild.detached", str(build_dir), "--", *argv]
    with open(build_dir / LOG, "wb") as log:
        process = subprocess.Popen(keeper, cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    # The keeper writes the record itself (so a build that ends at once still gets its exit status).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = read(build_dir)
        if record and record.get("pid") == process.pid:
            return record, True
        if process.poll() is not None and not (record and record.get("pid") == process.pid):
            raise RuntimeError(f"the detached build's keeper exited at once (status {process.returncode}); see {build_dir / LOG}")
        time.sleep(0.05)
    return {"argv": argv[2:], "pid": process.pid, "started": time.time()}, True


def wait(build_dir: Path, timeout: Optional[float]) -> Optional[dict]:
    """The record once the build ended, or None if it still runs after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        record = read(build_dir)
        if record is None or not alive(record):
            return record
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def describe(build_dir: Path, tail: int = 5) -> list[str]:
    """What `cudabuild status` prints: the state, the stages done (stamps), the log's last lines."""
    record = read(build_dir)
    if record is None:
        return [f"no detached build in {build_dir}"]
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["started"]))
    command = " ".join(record["argv"])
    if alive(record):
        state = f"running since {since} (pid {record['pid']}): {command}"
    elif "rc" in record:
        took = record["ended"] - record["started"]
        verdict = "done" if record["rc"] == 0 else f"failed (exit status {record['rc']})"
        state = f"{verdict} after {took:.0f} s: {command}"
    else:
        state = f"died (started {since}, no exit status: killed, or the machine restarted); `cudabuild start` resumes it: {command}"
    stamps = sorted(p.stem for p in (build_dir / ".stamps").glob("*.json") if p.stat().st_mtime >= record["started"] - 1)
    if stamps:
        done = f"stages it ran or restored: {', '.join(stamps)}"
    elif alive(record):
        done = "stages it ran or restored: none yet"
    elif record.get("rc") == 0:
        done = "nothing needed building: every stage was up to date"
    else:
        done = "stages it ran or restored: none"
    lines = [state, done]
    try:
        log = (build_dir / LOG).read_text(errors="replace").splitlines()
    except OSError:
        log = []
    lines += [f"  {line}" for line in log[-tail:]]
    return lines


def _keep(build_dir: Path, argv: list[str]) -> int:
    """The keeper: run the build, then write its exit status into the record. A SIGTERM or SIGHUP
    to the keeper is passed on to the build's process group; the record says how it ended."""
    record = {"argv": argv[2:], "pid": os.getpid(), "started": time.time()}
    atomic_write_text(build_dir / RECORD, json.dumps(record, indent=1))
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal that started it may close
    rc = child.wait()
    record.update(rc=rc, ended=time.time())
    atomic_write_text(build_dir / RECORD, json.dumps(record, indent=1))
    return rc


if __name__ == "__main__":  # python -m cudabuild.detached BUILD_DIR -- ARGV...
    split = sys.argv.index("--")
    sys.exit(_keep(Path(sys.argv[1]), sys.argv[split + 1:]))

"""A build that outlives the command that starts it: `cudabuild start`, `cudabuild status`, `cudabuild wait`.

    cudabuild start model=qwen_moe target=cuda size=35b-a3b     # returns at once
    cudabuild status model=qwen_moe target=cuda size=35b-a3b    # running / done / failed, stages done, log tail
    cudabuild wait model=qwen_moe target=cuda size=35b-a3b --timeout 540   # its exit status, or 124 still running

A full-size build takes longer than a command may last on a machine lent for minutes (a device
call ends and takes its processes with it, unless they started a session of their own). `start`
runs `python -m doit export SETTINGS` in a new session, in a small keeper process of this module
that writes the build's exit status when it ends; the build's output goes to
build/<model>/<target>/detached.log, and build/<model>/<target>/detached.json says what runs:
{argv, settings, build (model, target, options and specs: what `doit export` resolved them to),
run (the build's id), keeper pid, started, and once it ended: rc, ended, stages}. A second `start`
of the same build while it runs says so and starts nothing; of another build of the same folder
(other options), it is refused: the two would write one build/. `status` and `wait` find the
record of exactly their settings' build, and say which build the folder's record is of otherwise.
A build that died (killed, the machine taken back) leaves its finished stages in the cache:
`start` again resumes it, and only the unfinished stages run.

The stages a build ran or restored are those whose stamps carry its run id: the keeper gives the
build its id ($CUDABUILD_RUN_ID, which cudabuild.doit_tasks.DoitRun takes for its run_id), and keeps the
list in the record once the build ended, so that a later build of the folder, which rewrites
stamps, does not change what `status` says of this one. (A stamp's time said nothing of whose it was.)

Owns the keeper and its record; knows nothing of stages beyond reading their stamps' run ids and
statuses for `status`. No torch here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

from cudabuild.engine.files import atomic_write_text
from cudabuild.errors import CudabuildError
from cudabuild.options import shown

RECORD, LOG = "detached.json", "detached.log"
RUN_ENV = "CUDABUILD_RUN_ID"


class NoDetachedBuild(CudabuildError):
    """`status` or `wait` of settings whose build has no record in its folder; `other`: what the
    folder's record is of instead (its differences, and its settings)."""

    def __init__(self, settings: str, build_dir: Path, other: Optional[tuple[str, str]] = None):
        self.settings, self.build_dir, self.other = settings, build_dir, other
        there = ""
        if other is not None:
            differences, theirs = other
            there = f": the one there is of {differences} (`cudabuild status {theirs}` shows it)"
        super().__init__(f"no detached build of {settings or 'these settings'} in {build_dir}{there}",
                         fix=f"`cudabuild start {settings}` starts one")

    def __reduce__(self):
        return type(self), (self.settings, self.build_dir, self.other)


class DetachedBusy(CudabuildError):
    """`start` while a build of other settings runs in the same folder: the two would write one build/."""

    def __init__(self, build_dir: Path, pid: int, differences: str, theirs: str):
        self.build_dir, self.pid, self.differences, self.theirs = build_dir, pid, differences, theirs
        super().__init__(f"a detached build of {differences} runs in {build_dir} (pid {pid}), the folder this build "
                         "would write", fix=f"`cudabuild wait {theirs}` waits for it; then start this one")

    def __reduce__(self):
        return type(self), (self.build_dir, self.pid, self.differences, self.theirs)


def build_of(model: str, target: str, options: Mapping[str, Any], specs: Mapping[str, Mapping[str, Any]]) -> dict:
    """What makes one build of a folder another (its options and specs, as `doit export` resolved
    them), as the record keeps it: plain JSON data, so that two equal builds compare equal."""
    data = {"model": model, "target": target, "options": dict(options), "specs": {m: dict(s) for m, s in specs.items()}}
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def differences(theirs: Mapping, ours: Mapping) -> str:
    """The options and specs where build `theirs` is not `ours`, with their values: `layers=2`."""
    found = []
    for name in sorted(set(theirs.get("options", {})) | set(ours.get("options", {}))):
        value = theirs.get("options", {}).get(name)
        if value != ours.get("options", {}).get(name):
            found.append(f"{name}={shown(value) if value is not None else '(default)'}")
    their_specs, our_specs = theirs.get("specs", {}), ours.get("specs", {})
    for method in sorted(set(their_specs) | set(our_specs)):
        for key in sorted(set(their_specs.get(method, {})) | set(our_specs.get(method, {}))):
            value = their_specs.get(method, {}).get(key)
            if value != our_specs.get(method, {}).get(key):
                found.append(f"{method}.{key}={value if value is not None else '(default)'}")
    return " ".join(found) or "the same settings"


def read(build_dir: Path) -> Optional[dict]:
    try:
        return json.loads((build_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None


def is_of(record: dict, build: Optional[Mapping]) -> bool:
    """Whether the record is of `build` (a record of an older cudabuild says nothing of its build: taken for any)."""
    return build is None or record.get("build") is None or record["build"] == build


def _settings_of(record: dict) -> str:
    return " ".join(record.get("settings") or [a for a in record.get("argv", [])[2:]])


def find(build_dir: Path, build: Mapping, settings: list[str]) -> dict:
    """The record of `build` in its folder, or NoDetachedBuild saying what the folder holds instead."""
    record = read(build_dir)
    if record is None:
        raise NoDetachedBuild(" ".join(settings), build_dir)
    if not is_of(record, build):
        raise NoDetachedBuild(" ".join(settings), build_dir, (differences(record["build"], build), _settings_of(record)))
    return record


def alive(record: Optional[dict]) -> bool:
    """Whether the record's keeper still runs (and is the keeper: a reused pid is not)."""
    if not record or "rc" in record:
        return False
    try:
        with open(f"/proc/{record['pid']}/cmdline", "rb") as f:
            return b"cudabuild.detached" in f.read()
    except OSError:
        return False


def start(build_dir: Path, project: Path, settings: list[str], build: Optional[Mapping] = None,
          env: Optional[dict] = None) -> tuple[dict, bool]:
    """Start the build detached, unless it runs already: (its record, started now). DetachedBusy
    where a build of other settings runs in the folder."""
    record = read(build_dir)
    if alive(record):
        if is_of(record, build):
            return record, False
        raise DetachedBusy(build_dir, record["pid"], differences(record["build"], build), _settings_of(record))
    build_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "doit", "export", *settings]
    about = {"settings": list(settings), "build": build, "run": uuid.uuid4().hex}
    keeper = [sys.executable, "-m", "cudabuild.detached", str(build_dir), json.dumps(about), "--", *argv]
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
    return {"argv": argv[2:], "pid": process.pid, "started": time.time(), **about}, True


def wait(build_dir: Path, timeout: Optional[float], build: Optional[Mapping] = None) -> Optional[dict]:
    """The record once the build ended, or None if it still runs after `timeout` seconds. (A record
    of another build, written by a `start` meanwhile, ends the wait: this build is over.)"""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        record = read(build_dir)
        if record is None or not alive(record) or not is_of(record, build):
            return record
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def stages_of_run(build_dir: Path, run: str) -> dict[str, str]:
    """{stage: ran | restored | remote} of the stamps in the folder that the build `run` wrote."""
    found = {}
    for path in sorted((build_dir / ".stamps").glob("*.json")):
        try:
            stamp = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(stamp, dict) and stamp.get("run") == run:
            found[path.stem] = str(stamp.get("status") or "ran")
    return found


def describe(build_dir: Path, tail: int = 5, record: Optional[dict] = None) -> list[str]:
    """What `cudabuild status` prints: the state, the stages this build ran or restored, the log's last lines."""
    record = read(build_dir) if record is None else record
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
    if "run" not in record:
        done = "stages it ran or restored: not recorded (a record of an older cudabuild)"
    else:
        # Once it ended, what the keeper kept; while it runs (or after it died), its stamps now.
        stages = record["stages"] if "stages" in record else stages_of_run(build_dir, record["run"])
        if stages:
            done = "stages it ran or restored: " + ", ".join(
                stage if status == "ran" else f"{stage} ({status})" for stage, status in sorted(stages.items()))
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


def _keep(build_dir: Path, about: dict, argv: list[str]) -> int:
    """The keeper: run the build under its run id, then write its exit status and the stages it
    ran or restored into the record. A SIGTERM or SIGHUP to the keeper is passed on to the build's
    process group; the record says how it ended."""
    record = {"argv": argv[2:], "pid": os.getpid(), "started": time.time(), **about}
    atomic_write_text(build_dir / RECORD, json.dumps(record, indent=1))
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=dict(os.environ, **{RUN_ENV: about["run"]}))

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal that started it may close
    rc = child.wait()
    record.update(rc=rc, ended=time.time(), stages=stages_of_run(build_dir, about["run"]))
    atomic_write_text(build_dir / RECORD, json.dumps(record, indent=1))
    return rc


if __name__ == "__main__":  # python -m cudabuild.detached BUILD_DIR ABOUT_JSON -- ARGV...
    split = sys.argv.index("--")
    sys.exit(_keep(Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[split + 1:]))

"""Fault injection for tests/test_hardening.py: builds started in the background and SIGKILLed at a
chosen moment, stages made to run again, damaged blobs, small disks, and the checks a build must
pass afterwards.

Everything here acts on real processes and files: a stage is "forgotten" by deleting its stamp and
its record (what gc eviction does), a kill is SIGKILL to the build's whole process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from _kill_hook import MARKER
from conftest import Project

from cudabuild.engine import diskcache_rows
from cudabuild.engine.store import Store

MODEL, TARGET = "tiny_lm", "cpu"
BUILD_ARGS = (f"model={MODEL}", f"target={TARGET}")


def tmpfs(mount: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `mount` while the generator runs (for a fixture; skips the
    test where this process may not mount one, as outside root)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_dir(project: Project) -> Path:
    return project.root / "build" / MODEL / TARGET


def stamp(project: Project, stage_id: str) -> dict:
    return json.loads((build_dir(project) / ".stamps" / f"{stage_id}.json").read_text())


def forget(project: Project, *stage_ids: str, blobs: tuple[str, ...] = ()) -> None:
    """Delete the stages' stamps and records (and the named output blobs), so the next build runs them."""
    store = Store(project.cache)
    try:
        for stage_id in stage_ids:
            old = stamp(project, stage_id)
            store.actions.drop_record(old["key"])
            for name in blobs:
                store.objects.drop_blob(old["outputs"][name])
            (build_dir(project) / ".stamps" / f"{stage_id}.json").unlink()
    finally:
        store.close()


def blob_file(project: Project, blob_sha: str) -> Path:
    store = Store(project.cache)
    try:
        return store.objects.blob_path(blob_sha)
    finally:
        store.close()


def blob_files(project: Project) -> set[Path]:
    return set((project.cache / "store").rglob("*.val"))


def orphan_blob_files(project: Project) -> set[Path]:
    """Files in diskcache's directory that no row of its Cache table names."""
    store = Store(project.cache)
    try:
        return set(diskcache_rows.unnamed_files(store.table.cache))
    finally:
        store.close()


# -- builds in the background -------------------------------------------------------------------


@dataclass
class Background:
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 600) -> int:
        return self.proc.wait(timeout=timeout)


# `python -m doit ARGS`, with tests/_kill_hook installed first: sys.argv and the run of doit's
# __main__ are what -m gives (runpy, run_name "__main__"); the tests dir is on sys.path only to
# import the hook, and the build's cwd is first on it, as with -m.
_DOIT_WITH_KILL_HOOK = (
    "import sys, runpy; sys.path.insert(0, sys.argv.pop(1)); import _kill_hook; sys.path.pop(0); "
    "_kill_hook.install(); runpy.run_module('doit', run_name='__main__', alter_sys=True)"
)


def start_export(project: Project, log: Path, *args: str, kill_hook: bool = False, errors: Path | None = None,
                 **env) -> Background:
    """`doit export` in its own process group (so a kill reaches every process it started).

    kill_hook: the build kills its own process group right after diskcache has written the file of
    the first blob it stores and before that blob's row commits (see _kill_hook); off by default.
    errors: stderr goes there instead of into `log`.
    """
    doit = ["-c", _DOIT_WITH_KILL_HOOK, str(Path(__file__).resolve().parent)] if kill_hook else ["-m", "doit"]
    with open(log, "w") as out, open(errors or os.devnull, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, *doit, "export", *(args or BUILD_ARGS)], cwd=project.root,
            env=project.env(**env), stdout=out, stderr=err if errors else subprocess.STDOUT, start_new_session=True,
        )
    return Background(proc, log)


def killed_by_hook(build: Background, timeout: float = 300) -> tuple[str, Path]:
    """Wait for a kill_hook build to SIGKILL itself; (the blob's key, the file it left) from its line."""
    try:
        returncode = build.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(build.proc.pid, signal.SIGKILL)
        build.proc.wait()
        raise AssertionError(f"the build never stored a blob in {timeout}s:\n{build.output()[-3000:]}") from None
    output = build.output()
    assert returncode == -signal.SIGKILL, f"exit {returncode}, not SIGKILL:\n{output[-3000:]}"
    lines = [line for line in output.splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, output[-3000:]
    key, filename = lines[0][len(MARKER):].split()
    return key, Path(filename)


def kill_when(build: Background, ready: Callable[[], bool], timeout: float = 300) -> bool:
    """SIGKILL the build's process group as soon as `ready()`; False if the build ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if build.proc.poll() is not None:
            return False
        if ready():
            os.killpg(build.proc.pid, signal.SIGKILL)
            build.proc.wait()
            return True
        time.sleep(0.01)
    os.killpg(build.proc.pid, signal.SIGKILL)
    build.proc.wait()
    raise AssertionError(f"the moment to kill never came in {timeout}s:\n{build.output()[-3000:]}")


def signal_when(build: Background, ready: Callable[[], bool], signum: int, timeout: float = 600) -> bool:
    """Send `signum` to the build's process group as soon as `ready()`; False if the build ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if build.proc.poll() is not None:
            return False
        if ready():
            os.killpg(build.proc.pid, signum)
            return True
        time.sleep(0.01)
    os.killpg(build.proc.pid, signal.SIGKILL)
    build.proc.wait()
    raise AssertionError(f"the moment to signal never came in {timeout}s:\n{build.output()[-3000:]}")


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    state: str
    argv: list[str]

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name if self.argv else ""


def processes_marked(mark: str) -> list[Process]:
    """The live processes whose environment holds `mark` (a variable a test set for one build):
    the build's own, its compilers, and warm processes it started and what they run."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark.encode() not in (entry / "environ").read_bytes():
                continue
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state != "Z":
            found.append(Process(int(entry.name), int(ppid), state, argv))
    return found


COMPILERS = ("g++", "c++", "gcc", "cc1plus", "cc1", "as", "collect2", "ld", "clang++")


def stage_running_for(workdirs: Path, stage_id: str, seconds: float) -> Callable[[], bool]:
    """True once the stage's work directory (made in the cache's `work/` when its function starts)
    is `seconds` old."""
    seen: list[float] = []

    def ready() -> bool:
        if not seen and any(workdirs.glob(f"{stage_id}-*")):
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] >= seconds

    return ready


def new_blob_file(project: Project) -> Callable[[], bool]:
    """True once diskcache has created a blob file that was not there before."""
    before = blob_files(project)
    return lambda: bool(blob_files(project) - before)


# -- what must hold afterwards ------------------------------------------------------------------


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single `cudabuild: error:` line of a failed command (and no traceback anywhere)."""
    text = result.stdout + result.stderr
    assert result.returncode != 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("cudabuild: error:")]
    assert len(lines) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return lines[0]


def assert_same_outputs(project: Project, clean: Project) -> None:
    """The manifest names the clean build's outputs, and the files in build/ are those bytes."""
    want = clean.manifest(MODEL, TARGET)["outputs"]
    assert project.manifest(MODEL, TARGET)["outputs"] == want
    assert {name: sha(build_dir(project) / name) for name in want} == want


def assert_cache_verifies(project: Project) -> None:
    """`cudabuild cache verify`: every blob re-hashed, none corrupt, no record naming a missing one."""
    result = subprocess.run([sys.executable, "-m", "cudabuild", "cache", "verify"], cwd=project.root,
                            env=project.env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and " 0 dropped" in result.stdout, result.stdout + result.stderr
    assert "naming a blob this cache lacks" not in result.stdout, result.stdout

"""bench/: every script still runs, so that a benchmark that no longer does fails CI, not the next
person who needs its figure (bench/incremental.py stopped at its baseline once, unnoticed).

Each script answers --help (its imports and arguments). The CPU benches run for real in their
smallest form where that is cheap: incremental.py's baseline case (the stock lowering the headline
figures divide by), named_share.py and package_identity.py on the run's shared tiny build,
synthetic_checkpoint.py at the tiny size. The others build cold many times over (new_weights,
remote, cluster, disk_use: minutes; big_checkpoint: tens of GB) or need a GPU, and run by hand
(docs/benchmarks.md says how)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "bench").rglob("*.py") if not p.name.startswith("_"))


def bench(*args: str, cwd=REPO, env=None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_script_answers_help():
    for script in SCRIPTS:
        done = bench(script, "--help")
        assert done.returncode == 0 and "usage:" in done.stdout, f"{script}: {done.stderr[-2000:]}"


def test_the_session_script_names_only_scripts_that_exist():
    session = (REPO / "bench" / "gpu" / "session.sh").read_text()
    for named in sorted(set(__import__("re").findall(r"bench/[\w/]+\.py", session))):
        assert (REPO / named).exists(), named


def test_incremental_measures_its_baseline(tmp_path):
    done = bench("bench/incremental.py", "--cases", "a")
    assert done.returncode == 0, done.stderr[-3000:]
    seconds = float(done.stdout.split("a_baseline")[1].split()[0])
    assert seconds > 0


def test_named_share_reads_a_builds_trace(built_tiny):
    done = bench("bench/named_share.py", "--trace", str(built_tiny.build_dir / "trace.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("compile.")]
    assert len(rows) == 2 and all(" named " in row for row in rows)


def test_package_identity_finds_the_stand_in_package_identical(tiny_copy):
    done = bench(str(REPO / "bench" / "package_identity.py"), "tiny_lm", "cpu", cwd=tiny_copy.root, env=tiny_copy.env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["identical"] is True


def test_synthetic_checkpoint_writes_a_checkpoint_folder(tmp_path):
    done = bench("bench/synthetic_checkpoint.py", str(tmp_path / "ckpt"), "--size", "tiny", "--layers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ckpt" / "config.json").is_file() and list((tmp_path / "ckpt").glob("*.safetensors"))

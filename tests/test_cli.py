"""The `cudabuild` command line: help lists every command on one line, both entry points run, and
every user error is one line `cudabuild: error: ...` with exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, new_project
from cudabuild.cli import COMMANDS, main


def hermetic_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A command's environment: a project of its own (a copy of this checkout's dodo.py, cudabuild/
    and recipes/, with no build/ and no .doit.db), its own cache and HOME, and this checkout's
    cudabuild, whichever one the environment installed (the recipes import it). What the checkout
    holds (the README's everyday commands leave build/tiny_lm/cpu/detached.json) must not decide
    what a test sees."""
    project = tmp_path / "project"
    if not project.exists():
        new_project(tmp_path)
    return {"PATH": str(Path(sys.executable).parent), "CUDABUILD_CACHE_DIR": str(tmp_path / "cache"),
            "CUDABUILD_PROJECT": str(project), "HOME": str(tmp_path), "PYTHONPATH": str(REPO), **extra}


def run(args: list[str], tmp_path: Path, program: list[str] | None = None, **extra: str) -> subprocess.CompletedProcess:
    env = hermetic_env(tmp_path, **extra)
    # A bound for a hung command, not for a slow one: `explain` imports torch for the recipe, which
    # takes minutes on a machine busy with other builds.
    return subprocess.run((program or [sys.executable, "-m", "cudabuild"]) + args, env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def test_help_lists_each_command_on_one_line(tmp_path):
    done = run(["--help"], tmp_path)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    for name, words in COMMANDS:
        assert sum(1 for line in lines if line.split(words)[0].strip() == name) == 1, (name, done.stdout)
    assert "doit export" in done.stdout


def test_console_script_runs_the_same_main(tmp_path):
    script = Path(sys.executable).parent / "cudabuild"
    assert script.exists(), "pip install -e . declares the cudabuild console script"
    done = run(["cache", "stats"], tmp_path, program=[str(script)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no builds logged yet"


@pytest.mark.parametrize("args, message", [
    ([], "no command given; commands: explain, report, cache stats, cache verify, cache gc"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["cache"], "cache needs a command: stats, verify or gc"),
    (["cache", "gc"], "cache gc needs --max-size SIZE or --max-age DAYS"),
    (["cache", "gc", "--max-size", "5X"], "--max-size '5X' is not a size"),
    (["cache", "gc", "--max-age", "soon"], "expected a number of days, got 'soon'"),
    (["cache", "stats", "--last", "x"], "expected a whole number of builds, got 'x'"),
    (["explain", "model=nope"], "unknown model 'nope'; known models: "),
    (["explain", "model=tiny_lm", "max_autotune=MAYBE"], "invalid value max_autotune=MAYBE"),
    (["explain", "tiny_lm"], "explain takes NAME=VALUE settings as doit export does"),
    (["wait", "model=tiny_lm", "target=cpu"], "no detached build of model=tiny_lm target=cpu in "),
    (["status", "model=tiny_lm", "target=cpu"], "`cudabuild start model=tiny_lm target=cpu` starts one"),
    (["wait", "model=tiny_lm", "target=cpu", "--timeout", "-5"], "argument --timeout: expected a number of seconds >= 0, got '-5'"),
    (["status", "model=tiny_lm", "target=cpu", "target=cuda"], "target=cpu target=cuda: target is given 2 values; give target once"),
    (["explain", "modle=tiny_lm"], "unknown setting 'modle' for model qwen_moe (the default: no model= given); did you mean model=?"),
])
def test_errors_are_one_line_with_status_2(args, message, tmp_path):
    done = run(args, tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("cudabuild: error: "), done.stderr
    assert message in done.stderr


def test_every_config_problem_is_reported_with_status_2(tmp_path):
    done = run(["explain", "model=tiny_lm", "target=cpu", "sizee=1", "max_autotune=MAYBE"], tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("cudabuild: error: ")]
    for problem in ("unknown setting 'sizee' for model tiny_lm", "invalid value max_autotune=MAYBE"):
        assert any(problem in line for line in errors), done.stderr


def test_main_returns_the_status_in_process(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDABUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUDABUILD_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)  # a project with no build/
    assert main(["cache", "verify"]) == 0
    assert capsys.readouterr().out.strip() == "re-hashed 0 blobs (0 B): 0 intact, 0 dropped"
    assert main(["cache", "gc", "--max-size", "1G"]) == 0
    assert main(["cache", "nope"]) == 2
    assert capsys.readouterr().err.startswith("cudabuild: error: argument {stats,verify,gc}: invalid choice: 'nope'")


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    # `cudabuild cache stats | head -0`: the pipe is closed before anything is written to it.
    env = hermetic_env(tmp_path)
    command = subprocess.Popen([sys.executable, "-m", "cudabuild", "cache", "stats"], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    command.stdout.close()
    stderr = command.stderr.read().decode()
    assert command.wait(timeout=600) == 141  # what a process ended by SIGPIPE reports, as `git log | head` does
    assert stderr == ""


def test_warm_with_none_running_says_whose_it_lists_and_what_lists_every_caches(tmp_path):
    done = run(["warm"], tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith(f"no warm process of this cache ({tmp_path / 'cache'})")
    assert "--all lists every cache's" in done.stdout
    assert "warm [stop] [--all]" in run(["warm", "--help"], tmp_path).stdout

"""README.md's commands, run as a user pastes them into a shell: every fenced block whose info string
is `sh cpu-runnable` or `console cpu-runnable`.

They run in a clone after its first `doit export model=tiny_lm target=cpu` (the run's shared build,
copied): the repository's files in the current directory, `.venv/bin` first on PATH (as after
`source .venv/bin/activate`), an empty HOME whose ~/.cache/cudabuild is that build's cache, and no
CUDABUILD_* variable. An `sh` block runs as one script that stops at the first failing command; a
`console` block is a transcript: each `$ ` line is a command, the lines after it what it prints
(each found, in order, in its output; `...` stands for any text), exit status 2 where it prints a
`cudabuild: error:`, else 0.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

BLOCK = re.compile(r"^```(sh|console) cpu-runnable\n(.*?)^```\n", re.M | re.S)


def marked_blocks(text: str) -> list[tuple[str, str]]:
    return BLOCK.findall(text)


def transcript(block: str) -> list[tuple[str, list[str]]]:
    """[(command, the lines it prints)] of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return steps


def _shown(expected: str) -> re.Pattern:
    return re.compile("^" + ".*".join(re.escape(part) for part in expected.split("...")) + "$")


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """(the clone's folder, the environment of a shell in it)."""
    from conftest import tiny_build

    if sys.prefix == sys.base_prefix:
        pytest.skip("the README's commands are those of a virtual environment (.venv)")
    built = tiny_build(tmp_path_factory)
    where = tmp_path_factory.mktemp("readme")
    root, home = where / "clone", where / "home"
    shutil.copytree(built.root, root, symlinks=True)
    for tracked in ("README.md", "pyproject.toml", "scripts", "bench", "docs"):  # the rest of a clone
        (shutil.copytree if (REPO / tracked).is_dir() else shutil.copy)(REPO / tracked, root / tracked)
    shutil.copytree(built.cache, home / ".cache" / "cudabuild", symlinks=True)
    (root / ".venv").symlink_to(sys.prefix)
    env = {"PATH": f"{root / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
           "LANG": os.environ.get("LANG", "C.UTF-8"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    return root, env


def test_the_readme_marks_runnable_blocks_of_both_kinds():
    kinds = [kind for kind, _ in marked_blocks((REPO / "README.md").read_text())]
    assert "sh" in kinds and "console" in kinds


def test_the_setup_commands_are_the_ones_ci_runs():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    assert ci.strip().splitlines()[-1] in readme
    assert len(readme.splitlines()) <= 200


def test_each_sh_block_runs_as_pasted(clone):
    root, env = clone
    for kind, block in marked_blocks((REPO / "README.md").read_text()):
        if kind != "sh":
            continue
        done = subprocess.run(["bash", "-e", "-c", block], cwd=root, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{block}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        assert "internal error" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_each_console_transcript_prints_what_it_shows(clone):
    root, env = clone
    for kind, block in marked_blocks((REPO / "README.md").read_text()):
        if kind != "console":
            continue
        for command, shown in transcript(block):
            done = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=900)
            printed = (done.stdout + done.stderr).splitlines()
            want = 2 if any(line.startswith("cudabuild: error:") for line in shown) else 0
            assert done.returncode == want, f"$ {command}\n{done.stdout}{done.stderr}"
            at = 0
            for line in shown:
                pattern = _shown(line)
                found = next((i for i in range(at, len(printed)) if pattern.match(printed[i])), None)
                assert found is not None, f"$ {command}\nexpected: {line}\nprinted:\n" + "\n".join(printed)
                at = found + 1

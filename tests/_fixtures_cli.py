"""Real tiny_lm builds for the explain / cache / cli tests, made once per test session and cloned.

`tiny_lm_build()` runs `doit export model=tiny_lm target=cpu` (about 40 s) in a temporary project
holding copies of dodo.py, cudabuild/ and recipes/, with its own cache (CUDABUILD_CACHE_DIR) and
the default inductor directory. `scripted_builds()` clones it and adds three logged builds: a
no-op, a one-method spec change, and a rebuild after `rm -rf build`. Tests that change a project
or its cache work on a `clone()`. Every command runs in a subprocess with cwd = the project.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from cudabuild.toolchain import DEFAULT_INDUCTOR_DIR
BUILD = ("model=tiny_lm", "target=cpu")
SPEC_CHANGE = "decode.emulate_precision_casts=OFF"  # compile-only, and a quick compile (max_autotune takes ~30 s)


@dataclass(frozen=True)
class Project:
    root: Path  # holds project/ and cache/

    @property
    def project(self) -> Path:
        return self.root / "project"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def build_dir(self) -> Path:
        return self.project / "build" / "tiny_lm" / "cpu"

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "CUDABUILD_", "AOT_INDUCTOR_"))}
        env.update(CUDABUILD_CACHE_DIR=str(self.cache), CUDABUILD_INDUCTOR_DIR=DEFAULT_INDUCTOR_DIR, **extra)
        return env

    def run(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, *args], cwd=self.project, env=self.env(**env),
                              capture_output=True, text=True, timeout=600)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def doit(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return self.run("-m", "doit", *args, **env)

    def cudabuild(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        return self.run("-m", "cudabuild", *args, check=check, **env)

    def explain(self, *settings: str, **env: str) -> dict[str, str]:
        """{stage id: what explain says about it}."""
        out = self.cudabuild("explain", *BUILD, *settings, **env).stdout.splitlines()
        assert out[0] == "tiny_lm / cpu", out
        return dict(line.strip().split(None, 1) for line in out[1:])

    def stamp(self, stage: str) -> dict:
        return json.loads((self.build_dir / ".stamps" / f"{stage}.json").read_text())

    def clone(self, dest: Path) -> "Project":
        shutil.copytree(self.root, dest, symlinks=True)
        return Project(dest)


_MEMO: dict[str, Project] = {}


def tiny_lm_build(tmp_path_factory) -> Project:
    """The session's one real build (conftest.tiny_build), seen through this module's helpers."""
    from conftest import tiny_build

    return Project(tiny_build(tmp_path_factory).root.parent)


def scripted_builds(tmp_path_factory) -> Project:
    """A clone of the build with three more logged builds: no-op, SPEC_CHANGE, rm -rf build + rebuild."""
    if "scripted" not in _MEMO:
        scripted = tiny_lm_build(tmp_path_factory).clone(tmp_path_factory.mktemp("scripted") / "root")
        scripted.doit("export", *BUILD)
        scripted.doit("export", *BUILD, SPEC_CHANGE)
        shutil.rmtree(scripted.project / "build")
        scripted.doit("export", *BUILD)
        _MEMO["scripted"] = scripted
    return _MEMO["scripted"]

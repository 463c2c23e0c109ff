"""Shared fixtures: throwaway projects, caches, and one real tiny_lm build shared by many tests.

A test project is a copy of dodo.py, cudabuild/ and recipes/ in a tmp dir, with its own cache
dir, so a test can edit a recipe or corrupt the cache without touching anyone else's. The first
real build (about 70 s on 2 cores) happens once per test run, however many pytest-xdist workers
share the run (`shared_build`); tests that change things start from a copy of the built project
*and* of its cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent
os.environ["CUDABUILD_WARM"] = "0"  # builds made in this process, too (see Project.env)


@dataclass
class Project:
    root: Path  # the project: dodo.py, cudabuild/, recipes/, build/
    cache: Path  # its CUDABUILD_CACHE_DIR

    @property
    def build_dir(self) -> Path:
        return self.root / "build" / "tiny_lm" / "cpu"

    def env(self, **extra) -> dict:
        # Hermetic: a developer's own inductor, Triton, cudabuild or Dask settings (a shared Redis,
        # another inductor dir, a scheduler) must not reach a test's build; tests that want one pass
        # it in `extra`.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "CUDABUILD_", "AOT_INDUCTOR_", "DASK_"))}
        # One stage at a time unless a test asks for more (CUDABUILD_JOBS=N): up to 4 tests build
        # at once on 2 cores, and a build's second worker would import torch and ExecuTorch again.
        # The run's shared tiny build (_build_tiny) uses two workers: the default path of a
        # 2-core machine, under every test that reads it.
        # No warm processes (cudabuild.engine.warm) unless a test asks: each cache would get its own,
        # idle for minutes, a torch import each. The run's shared tiny build asks (the default path).
        env.update(CUDABUILD_CACHE_DIR=str(self.cache), CUDABUILD_PROJECT=str(self.root), PYTHONUNBUFFERED="1",
                   CUDABUILD_JOBS="1", CUDABUILD_WARM="0")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, *args: str, check: bool = True, timeout: float = 900, **env) -> subprocess.CompletedProcess:
        """`python ARGS` in the project; with check, a non-zero exit fails the test with its output."""
        done = subprocess.run([sys.executable, *args], cwd=self.root, env=self.env(**env),
                              capture_output=True, text=True, timeout=timeout)
        if check:
            assert_ok(done)
        return done

    def doit(self, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "doit", *args], cwd=self.root, env=env or self.env(),
            capture_output=True, text=True, timeout=timeout,
        )

    def export(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.doit("export", *args, **kw)

    def cudabuild(self, *args: str, check: bool = True, **env) -> subprocess.CompletedProcess:
        return self.run("-m", "cudabuild", *args, check=check, **env)

    def explain(self, *settings: str, **env) -> dict[str, str]:
        """{stage id: what `cudabuild explain model=tiny_lm target=cpu SETTINGS` says about it}."""
        out = self.cudabuild("explain", "model=tiny_lm", "target=cpu", *settings, **env).stdout.splitlines()
        assert out[0] == "tiny_lm / cpu", out
        return dict(line.strip().split(None, 1) for line in out[1:])

    def stamp(self, stage: str) -> dict:
        return json.loads((self.build_dir / ".stamps" / f"{stage}.json").read_text())

    def manifest(self, model: str = "tiny_lm", target: str = "cpu") -> dict:
        return json.loads((self.root / "build" / model / target / "manifest.json").read_text())

    def statuses(self, model: str = "tiny_lm", target: str = "cpu") -> dict[str, str]:
        return {
            (f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]): s["status"]
            for s in self.manifest(model, target)["stages"]
        }

    def copy(self, dest: Path) -> "Project":
        """The project and its cache copied under dest (as dest/project and dest/cache)."""
        shutil.copytree(self.root, dest / "project", symlinks=True)
        shutil.copytree(self.cache, dest / "cache", symlinks=True)
        return Project(dest / "project", dest / "cache")


def new_project(where: Path) -> Project:
    """A fresh project (this checkout's code and recipes) and an empty cache, but for what this
    machine already learned (see _MACHINE_FOLDERS)."""
    root = where / "project"
    root.mkdir(parents=True)
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    shutil.copytree(REPO / "cudabuild", root / "cudabuild", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "recipes", root / "recipes", ignore=shutil.ignore_patterns("__pycache__", "*.autotune.json"))
    project = Project(root, where / "cache")
    if _MACHINE["seed"]:
        _seed_machine(project.cache)
    return project


# What a developer's machine learns once and keeps in its cache, whatever it builds next: the CPU
# ISA probes' answers (cudabuild.backend.vec_isa) and the C++ objects AOTInductor compiled, keyed by
# their source and command line (cudabuild.backend.cpp_objects; a hit is the bytes a compile makes).
# A test's fresh cache starts with those of this process's copy of the run's shared tiny build,
# once it has one, as a cache on this machine would: its stages still run, but the C++ compiles of
# sources seen before (15 of a tiny_lm compile's 30 s on 2 cores) and the probes do not. Tests of
# those two caches themselves are marked `fresh_machine` and start with nothing.
_MACHINE_FOLDERS = ("vec_isa", "objects")
_MACHINE = {"seed": True}


def _seed_machine(cache: Path) -> None:
    if "built_tiny" not in _SESSION:
        return
    source = _SESSION["built_tiny"].cache
    for name in _MACHINE_FOLDERS:
        if (source / name).is_dir() and not (cache / name).exists():
            shutil.copytree(source / name, cache / name, symlinks=True)


@pytest.fixture(autouse=True)
def _machine_memory(request):
    """A test marked `fresh_machine` gets caches that know nothing of this machine."""
    _MACHINE["seed"] = request.node.get_closest_marker("fresh_machine") is None
    yield
    _MACHINE["seed"] = True


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def broken_recipe_text(project: Project) -> str:
    """recipes/tiny_lm.py turned into a model whose prefill cannot be exported (data-dependent
    control flow), for tests of a stage that fails. The model lives in cudabuild/models/tiny_lm.py:
    the broken one is a subclass in the recipe."""
    text = (project.root / "recipes" / "tiny_lm.py").read_text()
    return text.replace("def build(options) -> TinyLM:",
                        "class BrokenLM(TinyLM):\n    def forward(self, tokens, input_pos):\n        if tokens.sum() > 0:\n"
                        "            tokens = tokens + 0\n        return super().forward(tokens, input_pos)\n\n\n"
                        "def build(options) -> TinyLM:").replace("return TinyLM(TinyConfig(", "return BrokenLM(TinyConfig(")


@pytest.fixture
def project(tmp_path) -> Project:
    return new_project(tmp_path)


_SESSION: dict[str, Project] = {}


def shared_build(name: str, tmp_path_factory, make) -> Project:
    """This process's own copy of a project that `make(folder)` builds (returning the Project it
    made in that folder), built once per test run.

    Under pytest-xdist the workers share the run's temp dir: the first to ask builds there while
    the others wait on a file lock, and each then copies the finished folder (project, cache, and
    whatever else `make` left in it) into its own temp dir. So no two processes ever use one
    project or cache (a read-only command still writes the cache's file-hash memo), and a build
    that failed is tried again by the next asker.
    """
    if name in _SESSION:
        return _SESSION[name]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _SESSION[name] = make(tmp_path_factory.mktemp(name))
        return _SESSION[name]
    run_dir = tmp_path_factory.getbasetemp().parent
    shared, done = run_dir / f"shared-{name}", run_dir / f"shared-{name}.done"
    with FileLock(str(run_dir / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(shared, ignore_errors=True)
            built = make(shared)
            done.write_text(json.dumps({"root": str(built.root.relative_to(shared)),
                                        "cache": str(built.cache.relative_to(shared))}))
    where = json.loads(done.read_text())
    mine = tmp_path_factory.mktemp(name) / "copy"
    shutil.copytree(shared, mine, symlinks=True)
    _SESSION[name] = Project(mine / where["root"], mine / where["cache"])
    return _SESSION[name]


def _build_tiny(folder: Path) -> Project:
    proj = new_project(folder)
    # Two workers and warm processes: a 2-core machine's default path, with the warm process gone
    # soon after the build.
    result = proj.export("model=tiny_lm", "target=cpu",
                         env=proj.env(CUDABUILD_JOBS=2, CUDABUILD_WARM=1, CUDABUILD_WARM_IDLE_SECONDS=30))
    assert_ok(result)
    (folder / "export.out").write_text(json.dumps({"stdout": result.stdout, "stderr": result.stderr}))
    return proj


def tiny_build(tmp_path_factory) -> Project:
    """The run's one real `doit export model=tiny_lm target=cpu`, its stages run by two workers
    (read-only: copy it to change it)."""
    return shared_build("built_tiny", tmp_path_factory, _build_tiny)


def tiny_build_output(tmp_path_factory) -> subprocess.CompletedProcess:
    """What the run's one real build printed (stdout and stderr)."""
    printed = json.loads((tiny_build(tmp_path_factory).root.parent / "export.out").read_text())
    return subprocess.CompletedProcess(["doit", "export", "model=tiny_lm", "target=cpu"], 0, printed["stdout"], printed["stderr"])


@pytest.fixture(scope="session")
def built_tiny(tmp_path_factory) -> Project:
    return tiny_build(tmp_path_factory)


@pytest.fixture
def tiny_copy(built_tiny, tmp_path) -> Project:
    """A private copy of the built project and its cache, free to modify."""
    return built_tiny.copy(tmp_path)


def _cold_build(*settings: str):
    def make(folder: Path) -> Project:
        project = new_project(folder)
        assert_ok(project.export(*settings))
        return project

    return make


@pytest.fixture(scope="session")
def cold_seed_1(tmp_path_factory) -> Project:
    """A cold build of tiny_lm's seed 1 in a fresh project and cache, once per run (read-only):
    what a new seed after the run's seed-0 build must give, byte for byte."""
    return shared_build("tiny_seed_1", tmp_path_factory, _cold_build("model=tiny_lm", "target=cpu", "seed=1"))


@pytest.fixture(scope="session")
def built_qwen_cpu(tmp_path_factory) -> Project:
    """The run's one build of qwen_moe's CPU form (size tiny, the stock seed 42), read-only."""
    return shared_build("qwen_cpu", tmp_path_factory, _cold_build("model=qwen_moe", "target=cpu"))


@pytest.fixture(scope="session")
def cold_qwen_cpu_seed_7(tmp_path_factory) -> Project:
    """A cold build of qwen_moe's CPU form with seed 7 in a fresh project and cache, read-only."""
    return shared_build("qwen_cpu_seed_7", tmp_path_factory, _cold_build("model=qwen_moe", "target=cpu", "seed=7"))


from _s3_server import s3_env, s3_server  # noqa: E402,F401  the SeaweedFS S3 server (tests/_s3_server.py)

"""cudabuild.backend.cuda_env against fake CUDA installs built from real files and symlinks in tmp dirs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudabuild.backend.cuda_env import (
    CudaEnvPlan,
    cheap_cuda_fingerprint,
    find_ptxas,
    gpu_present,
    parse_cuda_version,
    plan_cuda_env,
    scoped_environ,
)

REPO = Path(__file__).resolve().parents[1]


def make_install(root: Path, content: str = "ptxas") -> Path:
    """A CUDA install at `root` with an executable bin/ptxas; returns the ptxas path."""
    (root / "bin").mkdir(parents=True)
    ptxas = root / "bin" / "ptxas"
    ptxas.write_text(f"#!/bin/sh\n# {content}\n")
    ptxas.chmod(0o755)
    (root / "version.json").write_text(json.dumps({"cuda": {"version": root.name}}))
    return ptxas


def two_installs(root: Path) -> Path:
    """`root/cuda-12.8` and `root/cuda-12.6`."""
    make_install(root / "cuda-12.8")
    make_install(root / "cuda-12.6")
    return root


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    """`<prefix>/cuda-12.8`, `<prefix>/cuda-12.6` and `<prefix>/cuda -> cuda-12.8`."""
    root = two_installs(tmp_path / "usr_local")
    (root / "cuda").symlink_to(root / "cuda-12.8")
    return root


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """Installs outside the prefix, for the steps after the versioned path."""
    return two_installs(tmp_path / "opt")


def test_parse_cuda_version():
    assert parse_cuda_version("12.8") == (12, 8)
    assert parse_cuda_version("13.0") == (13, 0)
    assert parse_cuda_version("12.8.1") == (12, 8)
    with pytest.raises(ValueError, match="'twelve'"):
        parse_cuda_version("twelve")


def test_torch_cuda_home_wins_and_keeps_the_unresolved_path(prefix, elsewhere):
    environ = {"CUDA_HOME": str(elsewhere / "cuda-12.8")}
    found = find_ptxas(
        "12.8", torch_cuda_home=str(prefix / "cuda"), environ=environ, versioned_prefix=str(prefix)
    )
    assert found == str(prefix / "cuda" / "bin" / "ptxas")


def test_env_homes_in_order_after_a_mismatched_torch_home(prefix, elsewhere):
    environ = {
        "CUDA_HOME": str(elsewhere / "cuda-12.6"),
        "CUDA_PATH": str(elsewhere / "cuda-12.8"),
        "CUDA_ROOT": str(prefix / "cuda-12.8"),
    }
    found = find_ptxas(
        "12.8",
        torch_cuda_home=str(prefix / "cuda-12.6"),
        environ=environ,
        versioned_prefix=str(prefix),
    )
    assert found == str(elsewhere / "cuda-12.8" / "bin" / "ptxas")
    del environ["CUDA_PATH"]
    assert find_ptxas("12.8", environ=environ, versioned_prefix=str(prefix)) == str(
        prefix / "cuda-12.8" / "bin" / "ptxas"
    )


def test_home_named_for_the_version_but_resolving_elsewhere_is_rejected(tmp_path, elsewhere):
    fake = tmp_path / "links" / "cuda-12.8"
    fake.parent.mkdir()
    fake.symlink_to(elsewhere / "cuda-12.6")
    empty_prefix = tmp_path / "empty"
    found = find_ptxas("12.8", torch_cuda_home=str(fake), environ={}, versioned_prefix=str(empty_prefix))
    assert found is None


def test_versioned_path_when_no_home_matches(prefix, elsewhere):
    environ = {"CUDA_HOME": str(elsewhere / "cuda-12.6"), "PATH": str(elsewhere / "cuda-12.8" / "bin")}
    found = find_ptxas("12.8", environ=environ, versioned_prefix=str(prefix))
    assert found == str(prefix / "cuda-12.8" / "bin" / "ptxas")


def test_versioned_path_is_taken_on_existence_alone(tmp_path, elsewhere):
    # As in the reference: <prefix>/cuda-X.Y is trusted without the real-path check.
    root = tmp_path / "usr_local"
    root.mkdir()
    (root / "cuda-12.8").symlink_to(elsewhere / "cuda-12.6")
    found = find_ptxas("12.8", environ={}, versioned_prefix=str(root))
    assert found == str(root / "cuda-12.8" / "bin" / "ptxas")


def test_ptxas_on_path_when_no_versioned_install(tmp_path, elsewhere):
    root = tmp_path / "usr_local"
    root.mkdir()
    (root / "cuda").symlink_to(elsewhere / "cuda-12.8")
    path_bin = tmp_path / "path_bin"
    path_bin.mkdir()
    (path_bin / "ptxas").symlink_to(elsewhere / "cuda-12.8" / "bin" / "ptxas")
    environ = {"PATH": f"{tmp_path / 'nothing'}{os.pathsep}{path_bin}"}
    assert find_ptxas("12.8", environ=environ, versioned_prefix=str(root)) == str(
        path_bin / "ptxas"
    )


def test_default_symlink_is_last_and_checked(tmp_path, elsewhere):
    root = tmp_path / "usr_local"
    root.mkdir()
    (root / "cuda").symlink_to(elsewhere / "cuda-12.8")
    environ = {"PATH": str(elsewhere / "cuda-12.6" / "bin")}  # a ptxas of the wrong version
    assert find_ptxas("12.8", environ=environ, versioned_prefix=str(root)) == str(
        root / "cuda" / "bin" / "ptxas"
    )
    assert find_ptxas("12.7", environ=environ, versioned_prefix=str(root)) is None


def _finder_that_must_not_run(version):
    raise AssertionError(f"ptxas looked up for {version}")


@pytest.mark.parametrize("version", ["12.9", "13.0", (13, 1)])
def test_native_multi_arch_sets_nothing(version):
    plan = plan_cuda_env(version, (9, 0), {}, _finder_that_must_not_run)
    assert plan.emit_multi_arch_kernel is True
    assert dict(plan.env) == {}


def test_12_8_pins_ptxas_and_arch_list(prefix):
    environ = {"CUDA_HOME": str(prefix / "cuda")}
    before = dict(os.environ)
    plan = plan_cuda_env(
        "12.8", (9, 0), environ, lambda v: find_ptxas(v, environ=environ, versioned_prefix=str(prefix))
    )
    assert plan.emit_multi_arch_kernel is True
    assert dict(plan.env) == {
        "TRITON_PTXAS_PATH": str(prefix / "cuda" / "bin" / "ptxas"),
        "TORCH_CUDA_ARCH_LIST": "9.0",
    }
    assert dict(os.environ) == before
    assert json.loads(json.dumps(plan.to_json()))["env"] == dict(plan.env)


def test_default_finder_reads_the_given_environ(prefix):
    plan = plan_cuda_env("12.8", (8, 6), {"CUDA_HOME": str(prefix / "cuda-12.8")})
    assert plan.env["TRITON_PTXAS_PATH"] == str(prefix / "cuda-12.8" / "bin" / "ptxas")


def test_user_arch_list_is_kept_and_noted():
    plan = plan_cuda_env("12.8", (9, 0), {"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}, lambda v: "/x/ptxas")
    assert plan.emit_multi_arch_kernel is True
    assert dict(plan.env) == {"TRITON_PTXAS_PATH": "/x/ptxas"}
    assert any("'8.0;9.0'" in note and "user" in note for note in plan.notes)


def test_no_matching_ptxas_turns_multi_arch_off():
    plan = plan_cuda_env("12.6", (9, 0), {}, lambda v: None)
    assert plan == CudaEnvPlan(False, {}, plan.notes)
    assert "12.6" in plan.notes[0]


def test_below_12_6_sets_only_the_arch_list():
    plan = plan_cuda_env("12.4", (8, 0), {}, _finder_that_must_not_run)
    assert plan.emit_multi_arch_kernel is True
    assert dict(plan.env) == {"TORCH_CUDA_ARCH_LIST": "8.0"}


def test_without_cuda_or_device_multi_arch_is_off():
    assert plan_cuda_env(None, None, {}, _finder_that_must_not_run).emit_multi_arch_kernel is False
    no_device = plan_cuda_env("12.8", None, {}, lambda v: "/x/ptxas")
    assert no_device.emit_multi_arch_kernel is False
    assert dict(no_device.env) == {"TRITON_PTXAS_PATH": "/x/ptxas"}


def test_plan_is_frozen():
    plan = plan_cuda_env("12.4", (8, 0), {})
    with pytest.raises(AttributeError):
        plan.emit_multi_arch_kernel = False
    with pytest.raises(TypeError):
        plan.env["X"] = "1"


def test_scoped_environ_restores_after_success_and_after_an_exception(monkeypatch):
    monkeypatch.setenv("CUDABUILD_TEST_KEPT", "old")
    monkeypatch.setenv("CUDABUILD_TEST_UNSET", "present")
    monkeypatch.delenv("CUDABUILD_TEST_NEW", raising=False)
    updates = {
        "CUDABUILD_TEST_KEPT": "new",
        "CUDABUILD_TEST_NEW": "1",
        "CUDABUILD_TEST_UNSET": None,
    }

    def assert_restored():
        assert os.environ["CUDABUILD_TEST_KEPT"] == "old"
        assert os.environ["CUDABUILD_TEST_UNSET"] == "present"
        assert "CUDABUILD_TEST_NEW" not in os.environ

    with scoped_environ(updates):
        assert os.environ["CUDABUILD_TEST_KEPT"] == "new"
        assert os.environ["CUDABUILD_TEST_NEW"] == "1"
        assert "CUDABUILD_TEST_UNSET" not in os.environ
    assert_restored()
    with pytest.raises(KeyError):
        with scoped_environ(updates):
            raise KeyError("boom")
    assert_restored()


@pytest.fixture
def machine(tmp_path: Path, prefix: Path):
    """A fake /proc and /dev beside the fake prefix."""
    gpu = tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:19:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA H200\nBus Location: \t 0000:19:00.0\n")
    (tmp_path / "proc" / "driver" / "nvidia" / "version").write_text("NVRM version: 580.159\n")
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia0"):
        (dev / name).write_text("")
    return {"prefix": str(prefix), "proc_root": str(tmp_path / "proc"), "dev_root": str(dev)}


def test_fingerprint_tracks_installs_env_and_gpus(machine, prefix, tmp_path):
    environ = {"CUDA_HOME": str(prefix / "cuda"), "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "HOME": "/h"}
    first = cheap_cuda_fingerprint(environ, **machine)
    assert json.loads(json.dumps(first)) == first
    assert first["env"] == {"CUDA_HOME": str(prefix / "cuda"), "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    assert "NVIDIA H200" in first["gpus"]["0000:19:00.0"]
    assert first["device_nodes"] == ["nvidia0", "nvidiactl"]
    assert cheap_cuda_fingerprint({**environ, "HOME": "/elsewhere"}, **machine) == first

    ptxas = prefix / "cuda-12.8" / "bin" / "ptxas"
    replacement = tmp_path / "new_ptxas"
    replacement.write_text("#!/bin/sh\n# a different ptxas build\n")
    os.replace(replacement, ptxas)
    after_ptxas = cheap_cuda_fingerprint(environ, **machine)
    assert after_ptxas != first
    assert after_ptxas["installs"][str(prefix / "cuda")]["realpath"] == str(prefix / "cuda-12.8")

    changed_env = cheap_cuda_fingerprint({**environ, "TRITON_CACHE_DIR": "/c"}, **machine)
    assert changed_env != after_ptxas
    assert cheap_cuda_fingerprint({**environ, "CUDA_VISIBLE_DEVICES": "1"}, **machine) != after_ptxas


def test_fingerprint_is_cheap_on_the_real_machine():
    cheap_cuda_fingerprint()
    start = time.perf_counter()
    for _ in range(10):
        cheap_cuda_fingerprint()
    assert (time.perf_counter() - start) / 10 < 0.05


def test_gpu_present(machine, tmp_path):
    roots = {"proc_root": machine["proc_root"], "dev_root": machine["dev_root"]}
    assert gpu_present({}, **roots) is True
    assert gpu_present({"CUDA_VISIBLE_DEVICES": "0"}, **roots) is True
    assert gpu_present({"CUDA_VISIBLE_DEVICES": ""}, **roots) is False
    assert gpu_present({"CUDA_VISIBLE_DEVICES": "-1"}, **roots) is False

    bare = tmp_path / "bare"
    (bare / "dev").mkdir(parents=True)
    (bare / "dev" / "nvidiactl").write_text("")  # the control node alone is no GPU
    bare_roots = {"proc_root": str(bare / "proc"), "dev_root": str(bare / "dev")}
    assert gpu_present({}, **bare_roots) is False
    (bare / "dev" / "nvidia3").write_text("")
    assert gpu_present({}, **bare_roots) is True


def test_import_and_fingerprint_stay_torch_free():
    code = (
        "import sys, cudabuild.backend.cuda_env as c; c.cheap_cuda_fingerprint(); c.gpu_present(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"

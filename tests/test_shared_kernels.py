"""cudabuild.backend.shared_kernels: Triton's cache manager that shares compiled kernels through
the remote tier. Triton cannot compile a kernel here (no GPU), so the test drives the manager as
Triton's compiler does (put each file, then put_group; get_group on the next compile), on two
"machines" (two kernel folders) sharing one real SeaweedFS bucket; tests/gpu and bench/cuda_target.py
run it under Triton."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from cudabuild.backend import kernel_cache, shared_kernels  # noqa: E402


def _machine(monkeypatch, folder, url):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(folder))
    monkeypatch.setenv("CUDABUILD_REMOTE", url)
    shared_kernels._TIERS.clear()  # a fresh process's tier


def _compile(key: str, files: dict[str, bytes]):
    """What Triton's compiler does with a kernel it compiled: each file, then the group."""
    manager = shared_kernels.SharedKernels(key)
    paths = {name: manager.put(data, name) for name, data in files.items()}
    manager.put_group(f"{key}.json", paths)
    return manager


def test_a_kernel_compiled_on_one_machine_is_found_on_the_next(s3_env, monkeypatch, tmp_path):
    url = s3_env.url("kernels")
    files = {"add_kernel.cubin": os.urandom(30_000), "add_kernel.json": b'{"name": "add_kernel"}'}
    key = "KERNELKEYABC"

    _machine(monkeypatch, tmp_path / "first", url)
    assert shared_kernels.SharedKernels(key).get_group(f"{key}.json") is None  # nobody compiled it yet
    _compile(key, files)

    _machine(monkeypatch, tmp_path / "second", url)
    found = shared_kernels.SharedKernels(key).get_group(f"{key}.json")
    assert sorted(found) == sorted(files)
    for name, path in found.items():
        assert path.startswith(str(tmp_path / "second")) and open(path, "rb").read() == files[name]
    # Now it is local: the group Triton reads names this machine's files.
    assert shared_kernels.SharedKernels(key).get_group(f"{key}.json") == found

    # A third machine whose tier is read-only finds it too, and publishes nothing of its own.
    _machine(monkeypatch, tmp_path / "third", url)
    monkeypatch.setenv("CUDABUILD_REMOTE_MODE", "read-only")
    _compile("OTHERKEY", {"k.cubin": b"x" * 100})
    monkeypatch.delenv("CUDABUILD_REMOTE_MODE")
    _machine(monkeypatch, tmp_path / "fourth", url)
    assert shared_kernels.SharedKernels("OTHERKEY").get_group("OTHERKEY.json") is None


def test_a_kernel_whose_blob_is_damaged_on_the_tier_is_compiled_again(s3_env, monkeypatch, tmp_path):
    url = s3_env.url("damaged")
    _machine(monkeypatch, tmp_path / "first", url)
    _compile("K2", {"k.cubin": b"good bytes" * 1000})
    prefix = url.split("/", 3)[3]
    client = s3_env.client()
    for obj in client.list_objects_v2(Bucket="cudabuild-cache", Prefix=f"{prefix}/blobs/").get("Contents", []):
        client.put_object(Bucket="cudabuild-cache", Key=obj["Key"], Body=b"bad bytes")

    _machine(monkeypatch, tmp_path / "second", url)
    assert shared_kernels.SharedKernels("K2").get_group("K2.json") is None
    assert not list((tmp_path / "second").rglob("k.cubin"))  # nothing half-fetched is left to be found


def test_the_compile_environment_shares_kernels_only_with_a_remote_tier(tmp_path):
    assert "TRITON_CACHE_MANAGER" not in kernel_cache.environment(tmp_path, {})
    env = kernel_cache.environment(tmp_path, {"CUDABUILD_REMOTE": "s3://b/p"})
    assert env["TRITON_CACHE_MANAGER"] == kernel_cache.SHARED_MANAGER
    assert "TRITON_CACHE_MANAGER" not in kernel_cache.environment(tmp_path, {"CUDABUILD_REMOTE": "s3://b/p",
                                                                             "TRITON_CACHE_MANAGER": "mine:Cache"})

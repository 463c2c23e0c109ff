"""cudabuild.engine.store: a cache folder opened, its table, object store and action cache on it; a
disk that fills up under an open store refuses its reads in one line (diskcache's reads write
access times) and loses nothing."""

from __future__ import annotations

import pytest

from _faults import tmpfs
from cudabuild.engine.tiers import base
from cudabuild.engine.store import Store
from cudabuild.errors import CacheUnwritable


@pytest.fixture(autouse=True)
def local_only(monkeypatch):
    """A developer's own CUDABUILD_REMOTE must not reach these stores; tests that want one set it."""
    monkeypatch.delenv(base.REMOTE_ENV, raising=False)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs (needs root and permission to mount)."""
    yield from tmpfs(tmp_path / "disk", 2 << 20)


def test_reads_of_an_open_store_on_a_disk_that_filled_up_fail_in_one_line_and_lose_nothing(tiny_disk):
    store = Store(tiny_disk / "cache")
    try:
        sha = store.objects.put_bytes(b"weights" * 1000)
        store.actions.put_json("recipe:tiny", {"methods": ["decode"]})
        source = tiny_disk / "recipe.py"
        source.write_text("x = 1\n")
        digest = store.hasher(source)
        filler = tiny_disk / "filler"
        with open(filler, "wb", buffering=0) as f:
            with pytest.raises(OSError):
                while True:
                    f.write(bytes(4096))

        # The file-hash memo is an optimisation: unreadable, it is a miss, and the file is hashed.
        assert store.hasher(source) == digest
        with pytest.raises(CacheUnwritable, match=f"cannot write to the cache at {tiny_disk / 'cache'} while reading blob {sha[:12]}: its disk is full"):
            store.objects.read_bytes(sha)
        with pytest.raises(CacheUnwritable, match="while reading the recipe document: its disk is full"):
            store.actions.get_json("recipe:tiny")

        filler.unlink()
        assert store.objects.read_bytes(sha) == b"weights" * 1000
        assert store.actions.get_json("recipe:tiny") == {"methods": ["decode"]}
    finally:
        store.close()

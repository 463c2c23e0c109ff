"""cudabuild.engine.object_store: a damaged blob is dropped and reported in one line, never served;
a blob from the remote tier passes through a scratch file that never stays behind."""

from __future__ import annotations

import hashlib
import os

import pytest

from test_remote import server  # noqa: F401  (a real redis-server on loopback, for the remote tier)
from cudabuild.engine.tiers import base
from cudabuild.engine.tiers.redis import RedisTier
from cudabuild.engine.store import Store
from cudabuild.errors import CorruptBlob, MissingBlob


@pytest.fixture(autouse=True)
def local_only(monkeypatch):
    """A developer's own CUDABUILD_REMOTE must not reach these stores; tests that want one set it."""
    monkeypatch.delenv(base.REMOTE_ENV, raising=False)


def _flip_a_byte(store: Store, sha: str) -> None:
    path = store.objects.blob_path(sha)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupt_blob_is_dropped_and_reported_in_one_line(tmp_path):
    store = Store(tmp_path / "cache")
    try:
        for copy_to in (None, tmp_path / "out" / "model.pte"):
            sha = store.objects.put_bytes(b"a blob that will not survive " + os.urandom(64))
            _flip_a_byte(store, sha)
            with pytest.raises(CorruptBlob) as raised:
                store.objects.read_bytes(sha) if copy_to is None else store.objects.fetch(sha, copy_to)
            for_name = "" if copy_to is None else " for model.pte"
            assert str(raised.value) == f"cached blob {sha[:12]}{for_name} failed its sha256 check; dropped, it will be rebuilt"
            assert not store.objects.has_blob(sha)
        assert list((tmp_path / "out").iterdir()) == [], "a corrupt copy is never put in place, nor its temporary file left"
    finally:
        store.close()


def test_blob_from_the_remote_tier_is_stored_and_its_scratch_file_deleted(server, tmp_path, monkeypatch):  # noqa: F811
    data = os.urandom(3 << 20)
    source = tmp_path / "blob"
    source.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    with open(source, "rb") as f:
        assert RedisTier(server.url, chunk_bytes=1 << 20).put_blob(sha, f)
    monkeypatch.setenv(base.REMOTE_ENV, server.url)
    store = Store(tmp_path / "cache")
    try:
        assert not store.objects.has_blob(sha)
        assert store.objects.fetch(sha, tmp_path / "out.bin").read_bytes() == data
        assert store.objects.has_blob(sha)
        with pytest.raises(MissingBlob):
            store.objects.fetch("0" * 64, tmp_path / "absent.bin")  # in neither tier
        assert list((tmp_path / "cache" / "incoming").iterdir()) == []
    finally:
        store.close()

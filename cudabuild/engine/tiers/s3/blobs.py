"""Blobs in an S3-compatible object store, content-addressed: `PREFIX/blobs/<sha256>`.

A tier (redis.RedisTier, or s3.tier.S3Tier in object-store-only mode) hands its blob calls here;
this module owns the blob objects and nothing else (no records, no leases, no local store).

- Streamed both ways in multipart parts with boto3's managed transfers, never whole in memory. The
  source and the sink are given to boto3 as non-seekable streams, so it reads and writes them in
  order and buffers at most a few parts (TRANSFER below): the memory a transfer takes does not grow
  with the blob.
- Uploads hash what they send; a source whose bytes turn out not to be `sha` (changed under us)
  aborts the upload before it completes, so no object with the wrong bytes is ever published. The
  object's size is checked afterwards.
- Downloads hash what arrives; only bytes that match `sha` are reported as a hit. An object whose
  bytes are wrong twice the same way (corrupt, truncated) is reported once, deleted (by a builder
  that may write), and not offered again in this process: the caller rebuilds it.
- `PREFIX/used/<sha256>`: an empty object rewritten whenever a read-write builder uploads or
  downloads the blob; its LastModified is the blob's last use, which `cache gc --remote` orders by
  (S3 keeps no access times). Read-only builders leave no trace.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from typing import BinaryIO, Callable, Iterable

from cudabuild.engine.tiers.base import mib
from cudabuild.engine.tiers.s3.client import MISSING, UNREACHABLE, Bucket, Refused

_SHA = re.compile(r"^[0-9a-f]{64}$")

PART_BYTES = 8 << 20
MAX_PARTS = 9000  # S3 allows 10,000 parts per upload; this leaves room
CONCURRENCY = 4
PARTS_IN_MEMORY = 4  # per direction: what a transfer holds at most, besides boto3's own


class _ChangedWhileReading(Exception):
    """The local blob's bytes did not hash to its name while they were being uploaded."""


class _HashingReader:
    """A read-only, non-seekable view of `source` that hashes what it hands out.

    Non-seekable, so boto3 reads it front to back, exactly once (it would read a seekable file
    twice, and in parallel ranges). read(n) returns n bytes unless the end was reached: boto3
    takes a short first read for a small file. At the end, it raises _ChangedWhileReading when the
    bytes were not `sha`, before boto3 sends the last part or completes the upload.
    """

    def __init__(self, source: BinaryIO, sha: str):
        self.source, self.sha = source, sha
        self.hash, self.size, self.done = hashlib.sha256(), 0, False

    def read(self, n: int = -1) -> bytes:
        if self.done:
            return b""
        want = n if n is not None and n >= 0 else 1 << 62
        pieces, got = [], 0
        while got < want:
            piece = self.source.read(min(want - got, 8 << 20))
            if not piece:
                self._finish()
                break
            pieces.append(piece)
            got += len(piece)
        data = b"".join(pieces)
        self.hash.update(data)
        self.size += len(data)
        if self.done and self.hash.hexdigest() != self.sha:
            raise _ChangedWhileReading(self.sha)
        return data

    def _finish(self) -> None:
        self.done = True

    def readable(self) -> bool:
        return True


class _HashingWriter:
    """A write-only, non-seekable sink: boto3 then writes the parts in order, and they are hashed as they land."""

    def __init__(self, out: BinaryIO):
        self.out, self.hash, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.out.write(data)


def transfer_config(size: int = 0):
    """boto3's TransferConfig for one blob: parts of PART_BYTES (more for a blob past MAX_PARTS of
    them), CONCURRENCY requests in flight, PARTS_IN_MEMORY parts buffered per direction."""
    from boto3.s3.transfer import TransferConfig

    part = max(PART_BYTES, -(-size // MAX_PARTS))
    part = -(-part // (1 << 20)) << 20  # whole MiB
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=CONCURRENCY,
                            max_io_queue=64, io_chunksize=256 << 10, preferred_transfer_client="classic")
    config.max_in_memory_upload_chunks = PARTS_IN_MEMORY
    config.max_in_memory_download_chunks = PARTS_IN_MEMORY
    return config


def _size_of(source) -> int:
    try:
        return os.fstat(source.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return 0


class S3Blobs:
    """The blob half of a remote tier, on one bucket and prefix (see the module docstring)."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket
        self.where = bucket.where
        self.stats = {"blobs_in": 0, "blobs_out": 0, "bytes_in": 0, "bytes_out": 0}
        self._bad: set[str] = set()  # blobs this process found corrupt or truncated remotely
        self._known: set[str] = set()  # blobs this process saw there (saves a HEAD per upload)
        self._lock = threading.Lock()

    @property
    def writable(self) -> bool:
        return self.bucket.writable

    def blob_key(self, sha: str) -> str:
        return self.bucket.key("blobs", sha)

    def used_key(self, sha: str) -> str:
        return self.bucket.key("used", sha)

    def has_blobs(self, shas: Iterable[str]) -> bool:
        """Whether the store holds every one of these blobs (one HEAD each, stopping at the first miss)."""
        shas = list(dict.fromkeys(shas))
        if any(sha in self._bad for sha in shas):
            return False
        for sha in shas:
            if sha in self._known:
                continue
            found = self.bucket.exists(self.blob_key(sha), f"lookup of blob {sha[:12]}")
            if found is not True:
                return False
            self._known.add(sha)
        return True

    def put_blob(self, sha: str, source: BinaryIO) -> bool:
        """Upload a blob's bytes from `source`, streamed; True when the store holds it with those bytes."""
        if not self.writable or not _SHA.match(sha):
            return False
        if self.has_blobs([sha]):
            self._mark_used(sha)
            return True
        reader = _HashingReader(source, sha)
        key = self.blob_key(sha)

        def upload(c):
            try:
                c.upload_fileobj(reader, self.bucket.bucket, key, Config=transfer_config(_size_of(source)))
            except _ChangedWhileReading:
                return None
            return c.head_object(Bucket=self.bucket.bucket, Key=key)["ContentLength"]

        stored = self.bucket.call(f"upload of blob {sha[:12]}", upload, write=True)
        if stored is UNREACHABLE:
            return False
        if stored is None:
            self.bucket.warn(f"local blob {sha[:12]} changed while it was uploaded to {self.where}; not published")
            return False
        if stored != reader.size:  # what the store kept is not what was sent
            self.bucket.warn(f"{self.where} kept {stored} of the {reader.size} bytes of blob {sha[:12]}; deleted it")
            self.bucket.delete(key, f"delete of blob {sha[:12]}")
            return False
        with self._lock:
            self._bad.discard(sha)
            self._known.add(sha)
            self.stats["blobs_out"] += 1
            self.stats["bytes_out"] += reader.size
        self._mark_used(sha)
        return True

    def get_blob_to_file(self, sha: str, dest: os.PathLike | str) -> bool:
        """Download a blob into `dest`, streamed; True only when the bytes that arrived hash to `sha`.

        Bytes that do not are read once more: the object is called corrupt (and deleted) only when
        both reads agree on the same wrong bytes, so a reply damaged on the way deletes nothing."""
        if sha in self._bad or not _SHA.match(sha):
            return False
        key = self.blob_key(sha)

        def download(c):
            with open(dest, "wb") as out:
                sink = _HashingWriter(out)
                c.download_fileobj(self.bucket.bucket, key, sink, Config=transfer_config())
            return sink

        digests = []
        for _ in range(2):
            sink = self.bucket.call(f"download of blob {sha[:12]}", download, expect=MISSING)
            if sink is UNREACHABLE:
                return False
            if isinstance(sink, Refused):  # deleted (gc, another builder) since it was looked up
                self._known.discard(sha)
                return False
            if sink.hash.hexdigest() == sha:
                with self._lock:
                    self.stats["blobs_in"] += 1
                    self.stats["bytes_in"] += sink.size
                self._mark_used(sha)
                return True
            digests.append(sink.hash.hexdigest())
        if digests[0] != digests[1]:  # two different wrong answers: the way, not the object
            self.bucket.failed(f"download of blob {sha[:12]}", "checksum mismatch",
                               ValueError(f"two reads of {sha[:12]} arrived as different wrong bytes"))
            return False
        with self._lock:
            self._bad.add(sha)
            self._known.discard(sha)
        writable = self.writable
        self.bucket.warn(f"remote blob {sha[:12]} failed its sha256 check on arrival, twice ({sink.size} bytes); "
                         f"{'deleted from' if writable else 'ignored in'} {self.where}, it will be rebuilt")
        if writable:
            self.bucket.delete(key, f"delete of blob {sha[:12]}")
        return False

    def _mark_used(self, sha: str) -> None:
        if self.writable:
            self.bucket.call(f"use of blob {sha[:12]}",
                             lambda c: c.put_object(Bucket=self.bucket.bucket, Key=self.used_key(sha), Body=b""),
                             write=True)

    def usage(self):
        """(blobs, bytes) in the store, by listing it; None when unreachable."""
        listing = self.bucket.listing(self.bucket.key("blobs", ""), "blob listing")
        if listing is None:
            return None
        return len(listing), sum(int(o.get("Size", 0)) for o in listing)

    def describe(self, head: str, records: Callable[[], str] = lambda: "") -> str:
        """What `cache stats` says of these blobs, after `head`: their count and bytes, by listing
        them; `records()`, asked only once the listing worked, is what the tier adds before them."""
        usage = self.usage()
        if usage is None:
            return f"{head} {self.where}: unreachable"
        return f"{head} {self.where}: object store, {records()}{usage[0]} blobs, {mib(usage[1])}"

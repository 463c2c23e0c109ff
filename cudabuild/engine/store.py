"""The content-addressed store: blobs by sha256, action records by stage key, on diskcache.

Layout inside one diskcache.Cache at `$CUDABUILD_CACHE_DIR` (default `~/.cache/cudabuild`):
- `blob:<sha256>`  -> the bytes, always as a file (diskcache writes it, then commits the row, so a
  killed writer leaves an orphan file, never a half-written entry);
- `rec:<key>`      -> JSON: what a stage with that action key produced
  (`{"stage", "digest", "outputs": {name: sha256}, "seconds", "created"}`);
- `stat:<path>`    -> the file-hash memo (see hashing.FileHasher);
- `spans:<sha256>` -> a blob kept as ranges of other blobs (cudabuild.engine.spans: one copy of a
  weight's bytes across the files that hold it), its bytes materialized under `spans/` beside the
  store only for a reader that needs a path, a file gc may delete;
- `range:<sha256>` -> where a plain blob holds those bytes: the index spans are found by.

Every blob is re-hashed on its way out; one that does not match is deleted and reported as
`CorruptBlob`, so callers rebuild it instead of serving it. Blobs of gigabytes are also handed out
as the store's own file (`verified_path`, to map or clone, never to write), checked once per change
of that file's stat signature rather than on every read. A record is only trusted when it is
well formed (cudabuild.engine.records, the check the remote tiers apply too) and all the blobs it
names are present; a damaged one is warned about, dropped, and read as a miss, so its stage runs
again. This module imports neither torch nor executorch, nor anything that builds on Store
(cache_admin enforces size limits from above). The few reads below diskcache's public API go
through cudabuild.engine.diskcache_rows.

With $CUDABUILD_REMOTE set, a shared tier (cudabuild.engine.tiers) sits behind this one: a record or
blob missing here is looked up there and copied in (checked against its sha256 on arrival), and
`push` writes a new record back, its blobs first. Without it, cudabuild.engine.tiers is never imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import diskcache

from cudabuild.errors import CacheUnwritable, CorruptBlob, MissingBlob
from cudabuild.engine import diskcache_rows, processes, spans
from cudabuild.engine.console import terminal
from cudabuild.engine.diskcache_rows import Entry
from cudabuild.engine.files import atomic_copy, atomic_write, temporary_file
from cudabuild.engine.hashing import CHUNK, FileHasher, sha256_file
from cudabuild.engine.records import well_formed

# An unnamed value file this old is a killed write's leftover, not one about to be committed.
ORPHAN_MIN_AGE_S = 3600

# A new record's write-back to the shared tier (publish), whole, as the tiers' clients try one
# call (cudabuild.engine.tiers.s3.client OP_ATTEMPTS, RETRY_PAUSE_S): each call retries first.
PUSH_ATTEMPTS = 3
PUSH_PAUSE_S = 0.2  # times the attempt number, between them

# Documents a shared tier keeps too: what a recipe declares and what its options resolve to (both
# keyed by the recipe's source digests), so a fresh machine restores without importing torch; and
# a compile's GEMM/conv tuning decisions (keyed by its tuning inputs), so it does not tune again.
SHARED_DOCS = ("recipe:", "options:", "tune:")

# diskcache culls past size_limit on every write; cudabuild evicts by its own rules (gc keeps what
# build/ references), so the limit is set beyond reach. LRU policy keeps access times up to date.
_NEVER_CULL = 2**62


class _TakingDisk(diskcache.Disk):
    """diskcache's Disk, which can also take a file in by renaming it (`Taken`): a stage's output
    of tens of GB then never exists twice on the disk (its work folder and the cache beside each
    other). Where a rename cannot (another filesystem), the bytes are copied, as diskcache does."""

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not isinstance(value, _Taken):
            return super().store(value, read, key=key)
        filename, full_path = self.filename(key, value)
        os.makedirs(os.path.dirname(full_path), exist_ok=True)
        try:
            os.rename(value.path, full_path)
            os.chmod(full_path, 0o644)
            return os.path.getsize(full_path), diskcache.core.MODE_BINARY, filename, None
        except OSError:
            with open(value.path, "rb") as f:
                return super().store(f, True, key=key)


class _Taken:
    """A file the store may take by renaming it (it is the caller's no more once stored)."""

    def __init__(self, path: os.PathLike | str):
        self.path = os.fspath(path)


def default_root() -> Path:
    return Path(os.environ.get("CUDABUILD_CACHE_DIR") or Path.home() / ".cache" / "cudabuild")


def remote_from_env():
    """The shared tier $CUDABUILD_REMOTE names, or None; connects to nothing until first used."""
    if not any(os.environ.get(name, "").strip() for name in ("CUDABUILD_REMOTE", "CUDABUILD_REMOTE_BLOBS")):
        return None
    from cudabuild.engine.tiers.factory import from_env  # only builds that name a remote tier import it (and, later, redis)

    return from_env(warn=terminal.warn)  # the terminal's stderr, also while a stage's output goes to its log


class Store:
    def __init__(self, root: os.PathLike | str | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        with self._refused("opening it"):  # SQLite writes on open: a full disk fails here
            self.cache = diskcache.Cache(
                str(self.root / "store"),
                size_limit=_NEVER_CULL,
                disk=_TakingDisk,
                eviction_policy="least-recently-used",
                timeout=60,
            )
        self.hasher = FileHasher(self.cache)
        # The shared tier behind this one (a cudabuild.engine.tiers.base.Tier); None means local only.
        self.remote = remote_from_env()
        self._damaged_warned: set[str] = set()  # record keys already warned about (once each)

    # -- blobs ---------------------------------------------------------------------------------

    def has_blob(self, sha: str) -> bool:
        # The row alone is not enough: diskcache keeps the bytes in a file of their own, and with
        # the file gone (deleted by hand, a partial restore of the cache dir) and the row kept,
        # put_file skipped the write, so a producer run again to replace the blob could never
        # make it readable and the build failed on every retry. A blob kept as spans is there
        # when every blob it reads from is.
        if self._plain(sha):
            return True
        manifest = self._spans(sha)
        return manifest is not None and all(self._plain(s) for s in spans.referenced(manifest))

    def _plain(self, sha: str) -> bool:
        return diskcache_rows.readable(self.cache, "blob:" + sha)

    def _spans(self, sha: str) -> Optional[dict]:
        raw = diskcache_rows.peek(self.cache, "spans:" + sha)
        try:
            manifest = json.loads(raw) if raw is not None else None
        except (ValueError, TypeError):
            manifest = None
        if raw is not None and not (isinstance(manifest, dict) and isinstance(manifest.get("parts"), list)):
            self.cache.delete("spans:" + sha)  # damaged: a miss, as a damaged record is
            return None
        return manifest

    def _locate(self, raw_sha: str, length: int) -> Optional[list]:
        """Where the store holds these bytes already (cudabuild.engine.spans.Locate): a range of a
        plain blob from the index, a whole plain blob, or a whole blob kept as spans (its parts)."""
        raw = diskcache_rows.peek(self.cache, "range:" + raw_sha)
        if raw is not None:
            where = json.loads(raw)
            if where.get("length") == length and self._plain(where.get("blob", "")):
                return [["blob", where["blob"], where["offset"], length]]
        if self._plain(raw_sha):
            return [["blob", raw_sha, 0, length]] if self.blob_bytes([raw_sha]) == length else None
        manifest = self._spans(raw_sha)
        if manifest is not None and manifest.get("size") == length and self.has_blob(raw_sha):
            return manifest["parts"]
        return None

    def _fill_holes(self, path, regions: list[tuple[int, int, str]], sha: str) -> None:
        """Write into a file its producer left holes in (put_file's digested regions) the bytes
        the store holds for them, so that it can be stored whole; SparseNotKept when a region's
        bytes are no longer held, or the file then is not what its producer hashed."""
        with open(path, "r+b") as out:
            for offset, length, raw_sha in regions:
                if raw_sha == spans.ZEROS or length < spans.MIN_REGION or spans.is_written(out, offset, length):
                    continue  # zeros read as zeros; small regions, and those the store lacked, were written
                parts = self._locate(raw_sha, length)
                if parts is None:
                    raise spans.SparseNotKept(f"{Path(path).name} leaves out bytes the store no longer holds; build again")
                out.seek(offset)
                reader = spans.SpanReader({"size": length, "parts": parts}, self._open_plain)
                try:
                    while chunk := reader.read(CHUNK):
                        out.write(chunk)
                finally:
                    reader.close()
        if sha256_file(path) != sha:
            raise spans.SparseNotKept(f"{Path(path).name} is not what its stage wrote once its holes are filled; build again")

    def holds(self, raw_sha: str, length: int) -> bool:
        """Whether the store holds these bytes already (by their own sha256), so a producer may
        leave them out of a file it is about to store (put_file's digested regions)."""
        return length >= spans.MIN_REGION and self._locate(raw_sha, length) is not None

    @contextlib.contextmanager
    def _refused(self, doing: str) -> Iterator[None]:
        """A write the cache's disk or SQLite refuses (a full disk, a read-only mount), reported as
        one line that names the cache and what was being done."""
        try:
            yield
        except (OSError, sqlite3.Error) as e:
            raise CacheUnwritable(_unwritable(self.root, doing, e)) from e

    def _set(self, key: str, value, what: str, read: bool = False) -> None:
        """diskcache's set. A write cut short leaves no entry behind: diskcache writes the file
        before the row and SQLite rolls the row back, so the store stays consistent and a later
        build with room stores the entry again."""
        with self._refused(f"storing {what}"):
            self.cache.set(key, value, read=read)

    def _get(self, key: str, what: str, **options):
        """diskcache's get. With the LRU policy a read is a write too (it updates the entry's
        access time), which a full disk refuses."""
        with self._refused(f"reading {what}"):
            return self.cache.get(key, **options)

    def put_file(self, path: os.PathLike | str, sha: Optional[str] = None, regions=None, take: bool = False) -> str:
        """Store a file's bytes under their sha256 (once: an existing blob is not rewritten).

        `regions` ([(offset, length)]: a tensor's bytes in the file, say) are where the file may
        repeat bytes the store holds already: when every big one does, the file is kept as spans
        of those (cudabuild.engine.spans), else plainly, its regions entered in the index so that
        later files can be kept as spans of it. A region given as (offset, length, sha256) was
        hashed by its producer already (spans.digested_regions): the file is then not read for it,
        and it may even be a hole, where its producer found the bytes stored already
        (`holds`); such a file must be kept as spans, and is refused (SparseNotKept) otherwise.

        With `take`, a file stored plainly is moved into the cache rather than copied (the caller
        gives it up: it is gone from `path` once this returns, whatever was stored)."""
        sha = sha or sha256_file(path)
        if self.has_blob(sha):
            if take:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return sha
        found = spans.digested_regions(path, regions) if regions else []
        if found:
            size = os.path.getsize(path)
            parts = spans.plan(path, size, found, self._locate)
            if parts is not None and spans.literal_bytes(parts) > spans.MAX_LITERAL:
                # Much glue: kept once, in a blob of its own, unless the file is mostly glue.
                parts = (spans.spilled(parts, self.put_bytes)
                         if spans.literal_bytes(parts) <= size * spans.MAX_MANIFEST_SHARE else None)
            text = json.dumps({"size": size, "parts": parts}, separators=(",", ":")) if parts is not None else None
            if text is not None and len(text) <= size * spans.MAX_MANIFEST_SHARE:
                self._set("spans:" + sha, text, Path(path).name)
                return sha
        if regions and any(len(r) == 3 for r in regions) and spans.has_holes(path):
            self._fill_holes(path, found, sha)  # not worth keeping as spans after all: stored whole
        if take:
            self._set("blob:" + sha, _Taken(path), Path(path).name)
        else:
            with open(path, "rb") as f:
                self._set("blob:" + sha, f, Path(path).name, read=True)
        # Its bytes were just hashed on their way in: verified_path need not read them again.
        self.hasher.remember(self.blob_path(sha), sha)
        for offset, length, raw_sha in found:
            if raw_sha != spans.ZEROS and length >= spans.MIN_REGION and diskcache_rows.peek(self.cache, "range:" + raw_sha) is None:
                where = {"blob": sha, "offset": offset, "length": length}
                self._set("range:" + raw_sha, json.dumps(where, sort_keys=True), "the index of stored bytes")
        return sha

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha):
            self._set("blob:" + sha, io.BytesIO(data), f"blob {sha[:12]}", read=True)
        return sha

    @contextlib.contextmanager
    def _open_blob(self, sha: str) -> Iterator[io.BufferedReader]:
        manifest = self.spans_of(sha)
        if manifest is not None:
            reader = spans.SpanReader(manifest, self._open_plain)
            try:
                yield reader
            finally:
                reader.close()
            return
        handle = self._get("blob:" + sha, f"blob {sha[:12]}", read=True)
        if handle is None:
            # diskcache also says None for a row whose file is gone: drop the row with it, or it
            # stays behind as an entry that can never be read.
            self.drop_blob(sha)
            raise MissingBlob(f"blob {sha[:12]} is not in the cache at {self.root}")
        try:
            yield handle
        finally:
            handle.close()

    def _open_plain(self, sha: str):
        handle = self._get("blob:" + sha, f"blob {sha[:12]}", read=True)
        if handle is None:
            raise MissingBlob(f"blob {sha[:12]}, which a stored file reads from, is not in the cache at {self.root}")
        return handle

    def _ensure_local(self, sha: str) -> None:
        """Copy a blob missing here from the remote tier, when there is one and it holds the blob."""
        if self.remote is None or self.has_blob(sha):
            return
        with temporary_file(self.root / "incoming", prefix=sha[:16] + ".") as tmp:
            if self.remote.get_blob_to_file(sha, tmp):  # verified against sha on arrival
                with open(tmp, "rb") as f:
                    self._set("blob:" + sha, f, f"blob {sha[:12]} from {self.remote.where}", read=True)

    def _hash_blob(self, sha: str, sink=None) -> str:
        """Stream a blob (into `sink`, when given) and return the sha256 of what was read."""
        h = hashlib.sha256()
        with self._open_blob(sha) as src:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                if sink is not None:
                    sink.write(chunk)
        return h.hexdigest()

    def fetch(self, sha: str, dest: os.PathLike | str) -> Path:
        """Put a blob's bytes at `dest` atomically (checked as verified_path checks them), by the
        cheapest copy that shares no writable storage with the store (files.clone_file). A corrupt
        blob is dropped and never replaces what dest held."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)  # as any atomic write does, whatever the check then finds
        self._ensure_local(sha)
        if self.spans_of(sha) is not None:  # written from its parts: no copy beside the store
            self._write_spans(sha, dest, for_name=dest.name)
            return dest
        atomic_copy(self.verified_path(sha, for_name=dest.name), dest)
        return dest

    def _write_spans(self, sha: str, dest: Path, for_name: Optional[str] = None) -> None:
        """A blob kept as spans written whole to `dest` (atomically), its bytes checked on the way."""
        # atomic_write: the file gets a plain file's mode, and goes on error
        atomic_write(dest, lambda out: self._check_streamed(sha, out, for_name))

    def verified_path(self, sha: str, for_name: Optional[str] = None) -> Path:
        """The blob's own file in the store, its bytes checked against `sha`: to read or map, never
        to write. The check is remembered under the file's stat signature (the hash memo), so a
        blob of gigabytes is re-hashed once per change of its file, not on every read. `for_name`:
        what the blob is for, in the error when it is corrupt (default: its file here)."""
        self._ensure_local(sha)
        if self.spans_of(sha) is not None:
            path = self.root / "spans" / sha  # materialized once, for readers that map a path
            if not (path.exists() and self.hasher(path) == sha):
                path.parent.mkdir(exist_ok=True)
                self._write_spans(sha, path, for_name)
                self.hasher.remember(path, sha)
            return path
        path = self.blob_path(sha)  # MissingBlob when it is gone
        if self.hasher(path) != sha:
            self.drop_blob(sha)
            raise CorruptBlob(sha, for_name or path.name)
        return path

    def read_bytes(self, sha: str) -> bytes:
        self._ensure_local(sha)
        data = io.BytesIO()
        if self._hash_blob(sha, data) != sha:
            self.drop_blob(sha)
            raise CorruptBlob(sha)
        return data.getvalue()

    def verify_blob(self, sha: str) -> bool:
        """Re-hash one blob; drop it and return False when it is corrupt or unreadable."""
        try:
            intact = self._hash_blob(sha) == sha
        except (MissingBlob, OSError):
            intact = False
        if not intact:
            self.drop_blob(sha)
        return intact

    def drop_blob(self, sha: str) -> None:
        self.cache.delete("blob:" + sha)
        self.cache.delete("spans:" + sha)
        with contextlib.suppress(FileNotFoundError):
            (self.root / "spans" / sha).unlink()

    def blob_path(self, sha: str) -> Optional[Path]:
        """Where diskcache keeps a blob's file (for tests that damage it on purpose)."""
        handle = self._get("blob:" + sha, f"blob {sha[:12]}", read=True)
        if handle is None:
            self.drop_blob(sha)
            raise MissingBlob(f"blob {sha[:12]} is not in the cache at {self.root}")
        handle.close()
        return Path(handle.name)

    def spans_of(self, sha: str) -> Optional[dict]:
        """The manifest of a blob kept as spans ({size, parts}), or None for a plain or absent one."""
        return None if self._plain(sha) else self._spans(sha)

    @contextlib.contextmanager
    def blob_file(self, sha: str, for_name: Optional[str] = None) -> Iterator[Path]:
        """A file of the blob's bytes for the block's length: the store's own for a plain blob (as
        verified_path); for one kept as spans, a private copy in memory (a memfd: a reader that
        needs a path once, a weights blob of 20 GB loaded onto the device, takes no disk for it),
        or where the system has none, on the disk beside the store; gone after the block."""
        self._ensure_local(sha)
        if self.spans_of(sha) is None:
            yield self.verified_path(sha, for_name)
            return
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(f"cudabuild-{sha[:16]}")
            try:
                with open(fd, "wb", closefd=False) as out:
                    self._check_streamed(sha, out, for_name)
                yield Path(f"/proc/{os.getpid()}/fd/{fd}")
            finally:
                os.close(fd)
            return
        folder = self.root / "spans"
        folder.mkdir(exist_ok=True)
        with temporary_file(folder, prefix=f".{sha[:16]}.") as tmp:
            self._write_spans(sha, Path(tmp), for_name)
            yield Path(tmp)

    def _check_streamed(self, sha: str, out, for_name: Optional[str]) -> None:
        """Stream a blob into `out`, checked against its sha256 on the way (dropped when it is not)."""
        try:
            got = self._hash_blob(sha, out)
        except (MissingBlob, OSError):
            got = None
        if got != sha:
            self.drop_blob(sha)
            if got is None:
                raise MissingBlob(f"blob {sha[:12]} reads from a blob that is gone from the cache at {self.root}")
            raise CorruptBlob(sha, for_name)

    def mapped_parts(self, sha: str) -> Optional[tuple[dict, dict[str, Path]]]:
        """For a blob kept as spans: (its manifest, {plain blob: its verified file}), so a reader can
        map the ranges instead of having the blob materialized; None for a plain one. A blob it reads
        from that is gone or corrupt raises, as verified_path does."""
        self._ensure_local(sha)
        manifest = self.spans_of(sha)
        if manifest is None:
            return None
        return manifest, {blob: self.verified_path(blob) for blob in sorted(spans.referenced(manifest))}

    # -- action records ------------------------------------------------------------------------

    def get_record(self, key: str) -> Optional[dict]:
        """The record for an action key, only if every blob it names is present."""
        return self.find_record(key)[0]

    def find_record(self, key: str) -> tuple[Optional[dict], str]:
        """(record, "local" or "remote"): like get_record, and says which tier had the record.

        A blob named by the record may be in either tier (fetch copies it in when it is needed); a
        record found remotely is copied into this store.
        """
        record, source = self._checked(key, self._get("rec:" + key, f"record {key[:12]}")), "local"
        if record is None and self.remote is not None:
            record, source = self.remote.get_record(key), "remote"
        if record is None or not self._blobs_reachable(record, remote_ok=True):
            return None, source
        if source == "remote":
            self.put_record(key, record)
        return record, source

    def put_record(self, key: str, record: dict) -> None:
        record = dict(record, created=record.get("created") or time.time())
        self._set("rec:" + key, json.dumps(record, sort_keys=True), f"the record of {record.get('stage', key[:12])}")

    def drop_record(self, key: str) -> None:
        self.cache.delete("rec:" + key)

    def push(self, key: str, record: dict, tier=None) -> bool:
        """Write a record back to the remote tier (`tier`, default self.remote): every blob it names
        first, then the record, so no reader there sees a record whose blobs are incomplete. False
        when there is no writable tier, a blob is missing here, or an upload did not complete."""
        return self._push(key, record, tier or self.remote) is None

    def publish(self, key: str, record: dict) -> Optional[str]:
        """push to the shared tier, tried again as the tiers try a call again (PUSH_ATTEMPTS, a
        longer pause each time) while it still takes writes: a fault one call's own retries did
        not outlast costs a second push, not the record. None once the record is there; else why
        not, in words, for the caller to say where it happens."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            why = self._push(key, record, self.remote)
            if why is None:
                return None
            # A tier given up, refusing writes or read-only refuses a try again too.
            if attempt == PUSH_ATTEMPTS or self.remote is None or not self.remote.writable:
                break
            time.sleep(PUSH_PAUSE_S * attempt)
        return why if attempt == 1 else f"{why}; tried {attempt} times"

    def _push(self, key: str, record: dict, tier) -> Optional[str]:
        """push: None once the record is in the tier, else why not."""
        if tier is None:
            return "no shared tier is set"
        if not tier.writable:
            return "it takes no writes from this process (read-only, or given up or refused a write earlier: see its warning)"
        for sha in sorted(set(record.get("outputs", {}).values())):
            if not self.has_blob(sha) and tier.has_blobs([sha]):
                continue  # handed on unchanged from a stage that ran on another machine: the tier has it
            try:
                with self._open_blob(sha) as handle:
                    if not tier.put_blob(sha, handle):
                        return f"the upload of blob {sha[:12]} failed"
            except MissingBlob:
                return f"blob {sha[:12]} is in neither this cache nor the tier"
        return None if tier.put_record(key, record) else "the write of its record failed"

    # -- small JSON documents (recipe descriptions, logs) ---------------------------------------

    def get_json(self, name: str) -> Optional[dict]:
        raw = self._get("doc:" + name, _doc_what(name))
        if raw is not None:
            return json.loads(raw)
        if self.remote is None or not name.startswith(SHARED_DOCS):
            return None
        # A fresh machine: what a recipe declares may already be known to the fleet, so the build
        # restores without importing the recipe (and torch). Copied in, so it is asked once.
        record = self.remote.get_record(_doc_key(name))
        value = (record or {}).get("value")
        if not isinstance(value, dict):
            return None
        self._put_doc(name, value)
        return value

    def put_json(self, name: str, value: dict) -> None:
        self._put_doc(name, value)
        if self.remote is not None and self.remote.writable and name.startswith(SHARED_DOCS):
            self.remote.put_record(_doc_key(name), _doc_record(name, value))

    def _put_doc(self, name: str, value: dict) -> None:
        """The local write of a document, whether made here or copied in from the shared tier."""
        self._set("doc:" + name, json.dumps(value, sort_keys=True), _doc_what(name))

    def shared_docs(self) -> Iterator[tuple[str, dict]]:
        """(tier key, record) of every document the shared tier also keeps (see SHARED_DOCS)."""
        for entry in self.entries("doc:"):
            name = entry.key[len("doc:"):]
            raw = diskcache_rows.peek(self.cache, entry.key) if name.startswith(SHARED_DOCS) else None
            if raw is not None:
                yield _doc_key(name), _doc_record(name, json.loads(raw))

    # -- build log (what `cudabuild cache stats` summarises) ------------------------------------

    def record_build(self, manifest: dict) -> None:
        """Append one finished build's manifest (stages, statuses, seconds) to the log."""
        # The options and specs too: `cudabuild report` tells builds of other settings apart by them.
        entry = {k: manifest[k] for k in ("model", "target", "options", "specs", "stages", "outputs") if k in manifest}
        entry["time"] = time.time()
        self._set(f"log:{entry['time']:017.6f}:{os.getpid()}", json.dumps(entry, sort_keys=True), "the build log")

    def build_log(self, last: Optional[int] = None) -> list[dict]:
        """Logged builds, oldest first; the last `last` only when given."""
        keys = sorted(k for k in self.cache.iterkeys() if isinstance(k, str) and k.startswith("log:"))
        if last is not None:
            keys = keys[-last:] if last > 0 else []
        entries = []
        for key in keys:
            raw = self._get(key, "the build log")
            if raw is not None:
                entries.append(json.loads(raw))
        return entries

    # -- inspection and eviction (cudabuild.engine.cache_admin, cudabuild.engine.explain) ---------------------
    # These read diskcache's `Cache` table directly (through diskcache_rows), so that looking does not
    # count as a use: the access_time that least-recently-used eviction orders by moves only when a
    # build reads an entry.

    def entries(self, prefix: str) -> list[Entry]:
        """Every entry whose key starts with `prefix` ("blob:", "rec:", ...), with its size and times."""
        return diskcache_rows.entries(self.cache, prefix)

    def blob_bytes(self, shas) -> int:
        """The bytes of the distinct blobs among `shas` that this cache holds (absent ones count 0;
        one kept as spans counts its manifest, what it takes on disk)."""
        keys = sorted({prefix + sha for sha in shas for prefix in ("blob:", "spans:")})
        return sum(diskcache_rows.sizes(self.cache, keys).values())

    def logical_bytes(self, shas) -> int:
        """The bytes of the distinct blobs among `shas` as they read: one kept as spans counts its
        whole size, not its manifest (what a stage that maps it holds in memory)."""
        total = 0
        for sha in sorted(set(shas)):
            manifest = self.spans_of(sha)
            total += manifest["size"] if manifest is not None else self.blob_bytes([sha])
        return total

    def usage(self) -> dict[str, tuple[int, int]]:
        """{key prefix ("blob", "rec", "stat", "doc", "log"): (entries, bytes)}."""
        return diskcache_rows.usage(self.cache)

    def size(self) -> int:
        """Bytes held in blobs and records: what a size limit (gc, CUDABUILD_CACHE_MAX_SIZE) bounds."""
        usage = self.usage()
        return sum(usage.get(kind, (0, 0))[1] for kind in ("blob", "rec", "spans"))

    def peek_record(self, key: str) -> Optional[dict]:
        """Like get_record, without marking the record as used."""
        record = self._checked(key, diskcache_rows.peek(self.cache, "rec:" + key))
        return record if record is not None and self._blobs_reachable(record, remote_ok=False) else None

    def locate_record(self, key: str) -> tuple[Optional[dict], str]:
        """(record, "local" or "remote") as find_record would serve it, changing nothing: no use is
        recorded and nothing is copied from the remote tier (a damaged local record is still
        dropped, as every read drops it). (None, "") when neither tier can."""
        record = self.peek_record(key)
        if record is not None:
            return record, "local"
        record = self.remote.get_record(key) if self.remote is not None else None
        if record is not None and self._blobs_reachable(record, remote_ok=True):
            return record, "remote"
        return None, ""

    def _blobs_reachable(self, record: dict, remote_ok: bool) -> bool:
        """Every blob the record names is here, or (remote_ok) in the remote tier."""
        missing = [sha for sha in record.get("outputs", {}).values() if not self.has_blob(sha)]
        return not missing or (remote_ok and self.remote is not None and self.remote.has_blobs(missing))

    def records(self) -> Iterator[tuple[str, dict]]:
        """Every well-formed (action key, record), without marking any as used; damaged ones are dropped."""
        for entry in self.entries("rec:"):
            key = entry.key[len("rec:"):]
            record = self._checked(key, diskcache_rows.peek(self.cache, entry.key))
            if record is not None:
                yield key, record

    def _checked(self, key: str, raw) -> Optional[dict]:
        """The record a local `rec:` value holds, or None for none. A damaged one (not JSON, or not
        well formed: a missing digest, an output outside build/) is a miss: dropped, so it cannot
        be one again, and warned about once, so its stage running again has a reason."""
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except (ValueError, TypeError):  # TypeError: a value that is not text at all
            record = None
        if well_formed(record):
            return record
        self.drop_record(key)
        if key not in self._damaged_warned:
            self._damaged_warned.add(key)
            stage = record.get("stage") if isinstance(record, dict) else None
            of = f" of {stage}" if isinstance(stage, str) else ""
            damage = "is malformed" if isinstance(record, dict) else "is not a JSON object"
            terminal.warn(f"cached record {key[:12]}{of} in {self.root} {damage}; dropped, its stage will run again")
        return None

    def orphan_files(self, min_age_s: float = ORPHAN_MIN_AGE_S, now: Optional[float] = None) -> list[tuple[Path, int]]:
        """Value files that no row names, as (path, bytes); what sweep_orphans deletes.

        A writer killed after diskcache wrote a blob's file and before its row committed leaves such
        a file: never served, but it holds disk until someone deletes it. Only files untouched for
        `min_age_s` count, so a write still in progress (file first, row a moment later) is left be.
        """
        now = time.time() if now is None else now
        found = []
        for path in diskcache_rows.unnamed_files(self.cache):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another sweep got there first
                continue
            if stat.st_mtime <= now - min_age_s:
                found.append((path, stat.st_size))
        return found

    @contextlib.contextmanager
    def work_folder(self, stage_id: str) -> Iterator[Path]:
        """A fresh folder for a stage's files, deleted after the block: beside the cache, on its
        filesystem, so that what the stage writes is moved into the cache, not copied; named by this
        process (`work/<stage>-<pid>-*`), so that what a killed stage leaves is swept (orphan_work)."""
        work = self.root / "work"
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{stage_id}-{os.getpid()}-", dir=work) as folder:
            yield Path(folder)

    def work_folders(self) -> list[tuple[Path, int, bool]]:
        """Every stage's work folder (work_folder), with its bytes and whether its process still
        runs (False: killed, what it was writing never stored)."""
        found = []
        for folder in sorted((self.root / "work").glob("*-*-*")):
            pid = folder.name.rsplit("-", 2)[1]  # <stage>-<pid>-<tempfile's suffix, which has no "-">
            if not pid.isdigit():
                continue
            size = 0
            with contextlib.suppress(OSError):  # a running stage's files (and folder) come and go
                for path in folder.rglob("*"):
                    with contextlib.suppress(OSError):
                        size += path.stat().st_size if path.is_file() and not path.is_symlink() else 0
            found.append((folder, size, processes.alive(int(pid))))
        return found

    def orphan_work(self) -> list[tuple[Path, int]]:
        """The work folders of stages whose process is gone (killed), with their bytes."""
        return [(folder, size) for folder, size, running in self.work_folders() if not running]

    def sweep_work(self) -> tuple[int, int]:
        """Delete the work folders of killed stages (orphan_work); (folders, bytes) deleted."""
        folders = swept = 0
        for folder, size in self.orphan_work():
            shutil.rmtree(folder, ignore_errors=True)
            folders, swept = folders + 1, swept + size
        return folders, swept

    def sweep_orphans(self, min_age_s: float = ORPHAN_MIN_AGE_S, now: Optional[float] = None) -> tuple[int, int]:
        """Delete the orphan_files; (files, bytes) deleted."""
        files = swept = 0
        for path, size in self.orphan_files(min_age_s, now):
            try:
                path.unlink()
            except FileNotFoundError:  # another sweep got there first
                continue
            files, swept = files + 1, swept + size
        return files, swept

    def evict(self, key: str) -> bool:
        """Delete one entry by its full key ("blob:<sha>", "rec:<key>"); False if it was already gone."""
        return self.cache.delete(key)

    def close(self) -> None:
        self.cache.close()


def _doc_what(name: str) -> str:
    return f"the {name.partition(':')[0]} document"  # "recipe:<digest>" -> "the recipe document"


def _doc_key(name: str) -> str:
    return hashlib.sha256(("doc:" + name).encode()).hexdigest()


def _doc_record(name: str, value: dict) -> dict:
    # The shape of an action record (no outputs), so both tiers store, sign and check it as one.
    return {"stage": "doc " + name.partition(":")[0], "digest": _doc_key(name), "outputs": {}, "value": value}


def _unwritable(root: Path, doing: str, error: BaseException) -> str:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    with contextlib.suppress(OSError):
        if shutil.disk_usage(root).free < 1 << 20:  # SQLite says "disk I/O error" when it cannot grow
            reason = f"its disk is full ({reason})"
    return (f"cannot write to the cache at {root} while {doing}: {reason}; free space there "
            f"(cudabuild cache gc --max-size SIZE) or set CUDABUILD_CACHE_DIR to a disk with room")

"""The object store: blobs by their sha256, on the cache folder's diskcache table.

Rows (cudabuild.engine.diskcache_rows.Table):
- `blob:<sha256>`  -> the bytes, always as a file (diskcache writes it, then commits the row, so a
  killed writer leaves an orphan file, never a half-written entry);
- `spans:<sha256>` -> a blob kept as ranges of other blobs (cudabuild.engine.spans: one copy of a
  weight's bytes across the files that hold it), its bytes materialized under `spans/` beside the
  store only for a reader that needs a path, a file gc may delete;
- `range:<sha256>` -> where a plain blob holds those bytes: the index spans are found by.

Every blob is re-hashed on its way out; one that does not match is deleted and reported as
`CorruptBlob`, so callers rebuild it instead of serving it. Blobs of gigabytes are also handed out
as the store's own file (`verified_path`, to map or clone, never to write), checked once per change
of that file's stat signature (the hash memo) rather than on every read. A blob missing here is
copied in from the shared tier behind it, when there is one (checked against its sha256 on arrival).

Also the object store's: the work folders stages write in beside it (`work/<stage>-<pid>-*`, on
its filesystem, so what a stage made is moved in, not copied), and the sweep of those a killed
stage left.

Owns blobs, spans, verified paths, work folders. Must not touch: records, documents or the build
log (cudabuild.engine.action_cache), what is in use (cudabuild.engine.cache_admin works that out
above it), or anything that imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.errors import CorruptBlob, MissingBlob
from cudabuild.engine import processes, spans
from cudabuild.engine.diskcache_rows import Table, Taken
from cudabuild.engine.files import atomic_copy, atomic_write, temporary_file
from cudabuild.engine.hashing import CHUNK, FileHasher, sha256_file


class ObjectStore:
    """Blobs by sha256 in `table`, the cache folder `root`'s; `remote`: the shared tier (a
    cudabuild.engine.tiers Tier) a blob missing here is copied in from, or None."""

    def __init__(self, table: Table, hasher: FileHasher, remote=None):
        self.table, self.hasher, self.remote = table, hasher, remote
        self.root = table.root

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
        return self.table.readable("blob:" + sha)

    def _spans(self, sha: str) -> Optional[dict]:
        raw = self.table.peek("spans:" + sha)
        try:
            manifest = json.loads(raw) if raw is not None else None
        except (ValueError, TypeError):
            manifest = None
        if raw is not None and not (isinstance(manifest, dict) and isinstance(manifest.get("parts"), list)):
            self.table.evict("spans:" + sha)  # damaged: a miss, as a damaged record is
            return None
        return manifest

    def _locate(self, raw_sha: str, length: int) -> Optional[list]:
        """Where the store holds these bytes already (cudabuild.engine.spans.Locate): a range of a
        plain blob from the index, a whole plain blob, or a whole blob kept as spans (its parts)."""
        raw = self.table.peek("range:" + raw_sha)
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
                self.table.set("spans:" + sha, text, Path(path).name)
                return sha
        if regions and any(len(r) == 3 for r in regions) and spans.has_holes(path):
            self._fill_holes(path, found, sha)  # not worth keeping as spans after all: stored whole
        if take:
            self.table.set("blob:" + sha, Taken(path), Path(path).name)
        else:
            with open(path, "rb") as f:
                self.table.set("blob:" + sha, f, Path(path).name, read=True)
        # Its bytes were just hashed on their way in: verified_path need not read them again.
        self.hasher.remember(self.blob_path(sha), sha)
        for offset, length, raw_sha in found:
            if raw_sha != spans.ZEROS and length >= spans.MIN_REGION and self.table.peek("range:" + raw_sha) is None:
                where = {"blob": sha, "offset": offset, "length": length}
                self.table.set("range:" + raw_sha, json.dumps(where, sort_keys=True), "the index of stored bytes")
        return sha

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha):
            self.table.set("blob:" + sha, io.BytesIO(data), f"blob {sha[:12]}", read=True)
        return sha

    @contextlib.contextmanager
    def open_blob(self, sha: str) -> Iterator[io.BufferedReader]:
        manifest = self.spans_of(sha)
        if manifest is not None:
            reader = spans.SpanReader(manifest, self._open_plain)
            try:
                yield reader
            finally:
                reader.close()
            return
        handle = self.table.get("blob:" + sha, f"blob {sha[:12]}", read=True)
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
        handle = self.table.get("blob:" + sha, f"blob {sha[:12]}", read=True)
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
                    self.table.set("blob:" + sha, f, f"blob {sha[:12]} from {self.remote.where}", read=True)

    def _hash_blob(self, sha: str, sink=None) -> str:
        """Stream a blob (into `sink`, when given) and return the sha256 of what was read."""
        h = hashlib.sha256()
        with self.open_blob(sha) as src:
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
        self.table.evict("blob:" + sha)
        self.table.evict("spans:" + sha)
        with contextlib.suppress(FileNotFoundError):
            (self.root / "spans" / sha).unlink()

    def blob_path(self, sha: str) -> Optional[Path]:
        """Where diskcache keeps a blob's file (for tests that damage it on purpose)."""
        handle = self.table.get("blob:" + sha, f"blob {sha[:12]}", read=True)
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

    def blob_bytes(self, shas) -> int:
        """The bytes of the distinct blobs among `shas` that this cache holds (absent ones count 0;
        one kept as spans counts its manifest, what it takes on disk)."""
        keys = sorted({prefix + sha for sha in shas for prefix in ("blob:", "spans:")})
        return sum(self.table.sizes(keys).values())

    def logical_bytes(self, shas) -> int:
        """The bytes of the distinct blobs among `shas` as they read: one kept as spans counts its
        whole size, not its manifest (what a stage that maps it holds in memory)."""
        total = 0
        for sha in sorted(set(shas)):
            manifest = self.spans_of(sha)
            total += manifest["size"] if manifest is not None else self.blob_bytes([sha])
        return total

    # -- work folders --------------------------------------------------------------------------

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


"""The content-addressed store: blobs by sha256, action records by stage key, on diskcache.

Layout inside one diskcache.Cache at `$CUDABUILD_CACHE_DIR` (default `~/.cache/cudabuild`):
- `blob:<sha256>`  -> the bytes, always as a file (diskcache writes it, then commits the row, so a
  killed writer leaves an orphan file, never a half-written entry);
- `rec:<key>`      -> JSON: what a stage with that action key produced
  (`{"stage", "digest", "outputs": {name: sha256}, "seconds", "created"}`);
- `stat:<path>`    -> the file-hash memo (see hashing.FileHasher).

Every blob is re-hashed on its way out; one that does not match is deleted and reported as
`CorruptBlob`, so callers rebuild it instead of serving it. A record is only trusted when all the
blobs it names are present. This module imports neither torch nor executorch.

With $CUDABUILD_REMOTE set, a shared tier (cudabuild.engine.remote) sits behind this one: a record or
blob missing here is looked up there and copied in (checked against its sha256 on arrival), and
`push` writes a new record back, its blobs first. Without it, cudabuild.engine.remote is never imported.
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
from typing import Iterator, NamedTuple, Optional

import diskcache

from cudabuild.errors import CacheUnwritable, CorruptBlob, MissingBlob
from cudabuild.engine.files import atomic_write
from cudabuild.engine.hashing import CHUNK, FileHasher, sha256_file

# An unnamed value file this old is a killed write's leftover, not one about to be committed.
ORPHAN_MIN_AGE_S = 3600

# diskcache culls past size_limit on every write; cudabuild evicts by its own rules (gc keeps what
# build/ references), so the limit is set beyond reach. LRU policy keeps access times up to date.
_NEVER_CULL = 2**62


def default_root() -> Path:
    return Path(os.environ.get("CUDABUILD_CACHE_DIR") or Path.home() / ".cache" / "cudabuild")


def remote_from_env():
    """The shared tier $CUDABUILD_REMOTE names, or None; connects to nothing until first used."""
    if not os.environ.get("CUDABUILD_REMOTE", "").strip():
        return None
    from cudabuild.engine.remote import from_env  # only builds that name a remote tier import it (and, later, redis)

    return from_env()


class Store:
    def __init__(self, root: os.PathLike | str | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.cache = diskcache.Cache(
                str(self.root / "store"),
                size_limit=_NEVER_CULL,
                eviction_policy="least-recently-used",
                timeout=60,
            )
        except (OSError, sqlite3.Error) as e:  # SQLite writes on open: a full disk fails here
            raise CacheUnwritable(_unwritable(self.root, "opening it", e)) from e
        self.hasher = FileHasher(self.cache)
        # The shared tier behind this one (cudabuild.engine.remote.RedisTier); None means local only.
        self.remote = remote_from_env()

    # -- blobs ---------------------------------------------------------------------------------

    def has_blob(self, sha: str) -> bool:
        # The row alone is not enough: diskcache keeps the bytes in a file of their own, and with
        # the file gone (deleted by hand, a partial restore of the cache dir) and the row kept,
        # put_file skipped the write, so a producer run again to replace the blob could never
        # make it readable and the build failed on every retry.
        rows = self.cache._sql("SELECT filename FROM Cache WHERE key = ? AND raw = 1", ("blob:" + sha,)).fetchall()
        return bool(rows) and (rows[0][0] is None or os.path.exists(os.path.join(self.cache.directory, rows[0][0])))

    def _set(self, key: str, value, what: str, read: bool = False) -> None:
        """diskcache's set, with a failed write reported as one line that names the cache.

        A write cut short (a full disk, a read-only mount) leaves no entry behind: diskcache writes
        the file before the row and SQLite rolls the row back, so the store stays consistent and a
        later build with room stores the entry again.
        """
        try:
            self.cache.set(key, value, read=read)
        except (OSError, sqlite3.Error) as e:
            raise CacheUnwritable(_unwritable(self.root, f"storing {what}", e)) from e

    def put_file(self, path: os.PathLike | str, sha: Optional[str] = None) -> str:
        """Store a file's bytes under their sha256 (once: an existing blob is not rewritten)."""
        sha = sha or sha256_file(path)
        if not self.has_blob(sha):
            with open(path, "rb") as f:
                self._set("blob:" + sha, f, Path(path).name, read=True)
        return sha

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha):
            self._set("blob:" + sha, io.BytesIO(data), f"blob {sha[:12]}", read=True)
        return sha

    @contextlib.contextmanager
    def _open_blob(self, sha: str) -> Iterator[io.BufferedReader]:
        handle = self.cache.get("blob:" + sha, read=True)
        if handle is None:
            # diskcache also says None for a row whose file is gone: drop the row with it, or it
            # stays behind as an entry that can never be read.
            self.drop_blob(sha)
            raise MissingBlob(f"blob {sha[:12]} is not in the cache at {self.root}")
        try:
            yield handle
        finally:
            handle.close()

    def _ensure_local(self, sha: str) -> None:
        """Copy a blob missing here from the remote tier, when there is one and it holds the blob."""
        if self.remote is None or self.has_blob(sha):
            return
        incoming = self.root / "incoming"
        incoming.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=incoming, prefix=sha[:16] + ".")
        os.close(fd)
        try:
            if self.remote.get_blob_to_file(sha, tmp):  # verified against sha on arrival
                with open(tmp, "rb") as f:
                    self._set("blob:" + sha, f, f"blob {sha[:12]} from {self.remote.where}", read=True)
        finally:
            os.unlink(tmp)

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
        """Copy a blob to `dest` atomically, verifying its hash; a corrupt blob is dropped."""
        self._ensure_local(sha)
        dest = Path(dest)

        def write(out):
            if self._hash_blob(sha, out) != sha:
                self.drop_blob(sha)
                raise CorruptBlob(f"cached blob {sha[:12]} for {dest.name} failed its sha256 check; dropped, it will be rebuilt")

        atomic_write(dest, write)  # a corrupt copy never replaces what dest held
        return dest

    def read_bytes(self, sha: str) -> bytes:
        self._ensure_local(sha)
        data = io.BytesIO()
        if self._hash_blob(sha, data) != sha:
            self.drop_blob(sha)
            raise CorruptBlob(f"cached blob {sha[:12]} failed its sha256 check; dropped, it will be rebuilt")
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

    def blob_path(self, sha: str) -> Optional[Path]:
        """Where diskcache keeps a blob's file (for tests that damage it on purpose)."""
        with self._open_blob(sha) as handle:
            return Path(handle.name)

    # -- action records ------------------------------------------------------------------------

    def get_record(self, key: str) -> Optional[dict]:
        """The record for an action key, only if every blob it names is present."""
        return self.find_record(key)[0]

    def find_record(self, key: str) -> tuple[Optional[dict], str]:
        """(record, "local" or "remote"): like get_record, and says which tier had the record.

        A blob named by the record may be in either tier (fetch copies it in when it is needed); a
        record found remotely is copied into this store.
        """
        raw = self.cache.get("rec:" + key)
        record, source = _record_from(raw), "local"
        if raw is not None and record is None:
            self.drop_record(key)  # unreadable: a miss, and gone so it cannot be one again
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
        tier = tier or self.remote
        if tier is None or not tier.writable:
            return False
        for sha in sorted(set(record.get("outputs", {}).values())):
            try:
                with self._open_blob(sha) as handle:
                    if not tier.put_blob(sha, handle):
                        return False
            except MissingBlob:
                return False
        return tier.put_record(key, record)

    # -- small JSON documents (recipe descriptions, logs) ---------------------------------------

    def get_json(self, name: str) -> Optional[dict]:
        raw = self.cache.get("doc:" + name)
        return json.loads(raw) if raw is not None else None

    def put_json(self, name: str, value: dict) -> None:
        self._set("doc:" + name, json.dumps(value, sort_keys=True), f"the {name.partition(':')[0]} document")

    # -- build log (what `cudabuild cache stats` summarises) ------------------------------------

    def record_build(self, manifest: dict) -> None:
        """Append one finished build's manifest (stages, statuses, seconds) to the log."""
        entry = {k: manifest[k] for k in ("model", "target", "stages", "outputs") if k in manifest}
        entry["time"] = time.time()
        self._set(f"log:{entry['time']:017.6f}:{os.getpid()}", json.dumps(entry, sort_keys=True), "the build log")

    def build_log(self, last: Optional[int] = None) -> list[dict]:
        """Logged builds, oldest first; the last `last` only when given."""
        keys = sorted(k for k in self.cache.iterkeys() if isinstance(k, str) and k.startswith("log:"))
        if last is not None:
            keys = keys[-last:] if last > 0 else []
        entries = []
        for key in keys:
            raw = self.cache.get(key)
            if raw is not None:
                entries.append(json.loads(raw))
        return entries

    # -- inspection and eviction (cudabuild.engine.cache_admin, cudabuild.engine.explain) ---------------------
    # These read diskcache's `Cache` table directly, so that looking does not count as a use: the
    # access_time that least-recently-used eviction orders by moves only when a build reads an entry.

    def entries(self, prefix: str) -> list[Entry]:
        """Every entry whose key starts with `prefix` ("blob:", "rec:", ...), with its size and times."""
        rows = self.cache._sql(
            "SELECT key, CASE WHEN filename IS NULL THEN COALESCE(length(value), 0) ELSE size END,"
            " access_time, store_time FROM Cache WHERE raw = 1 AND substr(key, 1, ?) = ?",
            (len(prefix), prefix),
        ).fetchall()
        return [Entry(*row) for row in rows]

    def usage(self) -> dict[str, tuple[int, int]]:
        """{key prefix ("blob", "rec", "stat", "doc", "log"): (entries, bytes)}."""
        rows = self.cache._sql(
            "SELECT substr(key, 1, instr(key, ':') - 1) AS kind, COUNT(*),"
            " SUM(CASE WHEN filename IS NULL THEN COALESCE(length(value), 0) ELSE size END)"
            " FROM Cache WHERE raw = 1 GROUP BY kind"
        ).fetchall()
        return {kind: (count, size or 0) for kind, count, size in rows}

    def size(self) -> int:
        """Bytes held in blobs and records: what a size limit (gc, CUDABUILD_CACHE_MAX_SIZE) bounds."""
        usage = self.usage()
        return sum(usage.get(kind, (0, 0))[1] for kind in ("blob", "rec"))

    def _peek(self, key: str):
        rows = self.cache._sql("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchall()
        if not rows:
            return None
        mode, filename, value = rows[0]
        try:
            return self.cache._disk.fetch(mode, filename, value, False)
        except OSError:  # deleted by another process between the select and the read
            return None

    def peek_record(self, key: str) -> Optional[dict]:
        """Like get_record, without marking the record as used."""
        record = _record_from(self._peek("rec:" + key))
        return record if record is not None and self._blobs_reachable(record, remote_ok=False) else None

    def locate_record(self, key: str) -> tuple[Optional[dict], str]:
        """(record, "local" or "remote") as find_record would serve it, changing nothing: no use is
        recorded and nothing is copied from the remote tier. (None, "") when neither tier can."""
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
        """Every (action key, record), readable or not-yet-dropped, without marking any as used."""
        for entry in self.entries("rec:"):
            record = _record_from(self._peek(entry.key))
            if record is not None:
                yield entry.key[len("rec:"):], record

    def sweep_orphans(self, min_age_s: float = ORPHAN_MIN_AGE_S, now: Optional[float] = None) -> tuple[int, int]:
        """Delete value files that no row names; (files, bytes) deleted.

        A writer killed after diskcache wrote a blob's file and before its row committed leaves such
        a file: never served, but it holds disk until someone deletes it. Only files untouched for
        `min_age_s` count, so a write still in progress (file first, row a moment later) is left be.
        """
        now = time.time() if now is None else now
        directory = Path(self.cache.directory)
        named = {row[0] for row in self.cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
        files = swept = 0
        for path in directory.glob("*/*/*.val"):
            if str(path.relative_to(directory)) in named:
                continue
            try:
                stat = path.stat()
                if stat.st_mtime > now - min_age_s:
                    continue
                path.unlink()
            except FileNotFoundError:  # another sweep got there first
                continue
            files, swept = files + 1, swept + stat.st_size
        return files, swept

    def evict(self, key: str) -> bool:
        """Delete one entry by its full key ("blob:<sha>", "rec:<key>"); False if it was already gone."""
        return self.cache.delete(key)

    def enforce_limit(self, project: os.PathLike | str):
        """Keep blobs and records under $CUDABUILD_CACHE_MAX_SIZE (unset: no limit).

        Evicts least-recently-used entries that no stamp under `project`/build/ references (see
        cache_admin.gc), so the current build's own inputs and outputs are never evicted, and what
        was evicted is never needed again by this build. Cheap when under the limit: one SQL sum.
        Returns cache_admin.GcReport when it evicted something, else None.
        """
        raw = os.environ.get(MAX_SIZE_ENV, "").strip()
        if not raw:
            return None
        from cudabuild.engine import cache_admin  # cache_admin builds on Store: imported here, not at module load

        limit = cache_admin.parse_size(raw, where=MAX_SIZE_ENV)
        if self.size() <= limit:
            return None
        return cache_admin.gc(self, Path(project), max_bytes=limit)

    def close(self) -> None:
        self.cache.close()


MAX_SIZE_ENV = "CUDABUILD_CACHE_MAX_SIZE"


def _record_from(raw) -> Optional[dict]:
    """A stored record, or None for no entry or an unreadable one (a damaged record is a miss)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _unwritable(root: Path, doing: str, error: BaseException) -> str:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    with contextlib.suppress(OSError):
        if shutil.disk_usage(root).free < 1 << 20:  # SQLite says "disk I/O error" when it cannot grow
            reason = f"its disk is full ({reason})"
    return (f"cannot write to the cache at {root} while {doing}: {reason}; free space there "
            f"(cudabuild cache gc --max-size SIZE) or set CUDABUILD_CACHE_DIR to a disk with room")


class Entry(NamedTuple):
    key: str
    bytes: int
    access_time: float
    store_time: float

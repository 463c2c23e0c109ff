"""The cache's one diskcache table (`Table`), and what cudabuild reads from diskcache below its
public API: the `Cache` table's rows and the layout of its value files.

`Table` opens `<cache>/store`, writes and reads rows (a write the disk or SQLite refuses is one line
that names the cache: CacheUnwritable), looks at them without using them, evicts them, and sweeps
the value files killed writers left. The object store (blobs, spans: object_store.py) and the
action cache (records, documents, the build log: action_cache.py) keep their rows here, each under
its key prefixes; this module knows nothing of blobs or records beyond those prefixes.

Everything that uses `cache._sql`, `cache._disk`, `cache.directory`, the `*/*/*.val` layout or the
shape of `Disk.store`'s answer lives here, so that a diskcache upgrade that changes them breaks
this module only (pyproject.toml pins the diskcache versions it was tested with).

Why go below the API at all: a public read (`Cache.get`) moves the entry's access_time, which
least-recently-used eviction orders by, so looking at the store (explain, `cudabuild cache ...`)
would count as using it; and `Cache.get` cannot tell a missing row from a row whose file is gone.
Rows here are str-keyed (`raw = 1` in diskcache's terms). Owns the table and every access below
diskcache's public API. Must not touch: what a row means.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

import diskcache

from cudabuild.errors import CacheUnwritable

# An unnamed value file this old is a killed write's leftover, not one about to be committed.
ORPHAN_MIN_AGE_S = 3600

# diskcache culls past size_limit on every write; cudabuild evicts by its own rules (gc keeps what
# build/ references), so the limit is set beyond reach. LRU policy keeps access times up to date.
_NEVER_CULL = 2**62

# The size of a row's value: its file's size, or the length of a value held in the row itself.
_BYTES = "CASE WHEN filename IS NULL THEN COALESCE(length(value), 0) ELSE size END"


class Entry(NamedTuple):
    key: str
    bytes: int
    access_time: float
    store_time: float


def readable(cache: diskcache.Cache, key: str) -> bool:
    """A row for `key` exists, and so does its value file when it has one (a row whose file was
    deleted by hand, or lost in a partial restore of the cache dir, is not readable)."""
    rows = cache._sql("SELECT filename FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchall()
    return bool(rows) and (rows[0][0] is None or os.path.exists(os.path.join(cache.directory, rows[0][0])))


def entries(cache: diskcache.Cache, prefix: str) -> list[Entry]:
    """Every row whose key starts with `prefix`, with its size and times; uses no entry."""
    rows = cache._sql(
        f"SELECT key, {_BYTES}, access_time, store_time FROM Cache WHERE raw = 1 AND substr(key, 1, ?) = ?",
        (len(prefix), prefix),
    ).fetchall()
    return [Entry(*row) for row in rows]


def sizes(cache: diskcache.Cache, keys: list[str]) -> dict[str, int]:
    """{key: bytes} of the rows among `keys` that exist; uses no entry."""
    found: dict[str, int] = {}
    for start in range(0, len(keys), 500):  # SQLite's bound on parameters per statement
        batch = keys[start:start + 500]
        marks = ",".join("?" * len(batch))
        rows = cache._sql(f"SELECT key, {_BYTES} FROM Cache WHERE raw = 1 AND key IN ({marks})", batch).fetchall()
        found.update(rows)
    return found


def usage(cache: diskcache.Cache) -> dict[str, tuple[int, int]]:
    """{key prefix (the part before the first ':'): (rows, bytes)}."""
    rows = cache._sql(
        f"SELECT substr(key, 1, instr(key, ':') - 1) AS kind, COUNT(*), SUM({_BYTES}) FROM Cache WHERE raw = 1 GROUP BY kind"
    ).fetchall()
    return {kind: (count, size or 0) for kind, count, size in rows}


def peek(cache: diskcache.Cache, key: str) -> Any:
    """The value stored under `key`, or None, without moving its access_time."""
    rows = cache._sql("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchall()
    if not rows:
        return None
    mode, filename, value = rows[0]
    try:
        return cache._disk.fetch(mode, filename, value, False)
    except OSError:  # deleted by another process between the select and the read
        return None


def unnamed_files(cache: diskcache.Cache) -> Iterator[Path]:
    """Value files in the cache's directory that no row names (a killed writer's leftovers, or a
    write whose row is about to commit: the caller tells them apart by age)."""
    directory = Path(cache.directory)
    named = {row[0] for row in cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    for path in directory.glob("*/*/*.val"):  # diskcache's layout: <2 hex>/<2 hex>/<name>.val
        if str(path.relative_to(directory)) not in named:
            yield path


class Taken:
    """A file the table may take by renaming it (it is the caller's no more once stored)."""

    def __init__(self, path: os.PathLike | str):
        self.path = os.fspath(path)


class TakingDisk(diskcache.Disk):
    """diskcache's Disk, which can also take a file in by renaming it (`Taken`): a stage's output
    of tens of GB then never exists twice on the disk (its work folder and the cache beside each
    other). Where a rename cannot (another filesystem), the bytes are copied, as diskcache does."""

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not isinstance(value, Taken):
            return super().store(value, read, key=key)
        filename, full_path = self.filename(key, value)
        os.makedirs(os.path.dirname(full_path), exist_ok=True)
        try:
            os.rename(value.path, full_path)
            os.chmod(full_path, 0o644)
            # Disk.store's answer: (size, mode, filename, value), as diskcache's own file writes give it.
            return os.path.getsize(full_path), diskcache.core.MODE_BINARY, filename, None
        except OSError:
            with open(value.path, "rb") as f:
                return super().store(f, True, key=key)


class Table:
    """The diskcache table of a cache folder (`root`/store): its rows, written and read with the
    cache named when the disk refuses, looked at without counting as a use, and swept."""

    def __init__(self, root: Path):
        self.root = root
        with self.refused("opening it"):  # SQLite writes on open: a full disk fails here
            self.cache = diskcache.Cache(
                str(root / "store"),
                size_limit=_NEVER_CULL,
                disk=TakingDisk,
                eviction_policy="least-recently-used",
                timeout=60,
            )

    @contextlib.contextmanager
    def refused(self, doing: str) -> Iterator[None]:
        """A write the cache's disk or SQLite refuses (a full disk, a read-only mount), reported as
        one line that names the cache and what was being done."""
        try:
            yield
        except (OSError, sqlite3.Error) as e:
            raise CacheUnwritable(_unwritable(self.root, doing, e)) from e

    def set(self, key: str, value, what: str, read: bool = False) -> None:
        """diskcache's set. A write cut short leaves no entry behind: diskcache writes the file
        before the row and SQLite rolls the row back, so the store stays consistent and a later
        build with room stores the entry again."""
        with self.refused(f"storing {what}"):
            self.cache.set(key, value, read=read)

    def get(self, key: str, what: str, **options):
        """diskcache's get. With the LRU policy a read is a write too (it updates the entry's
        access time), which a full disk refuses."""
        with self.refused(f"reading {what}"):
            return self.cache.get(key, **options)

    def peek(self, key: str) -> Any:
        """The value under `key`, or None, without counting as a use (`peek`)."""
        return peek(self.cache, key)

    def readable(self, key: str) -> bool:
        return readable(self.cache, key)

    def evict(self, key: str) -> bool:
        """Delete one entry by its full key ("blob:<sha>", "rec:<key>"); False if it was already gone."""
        return self.cache.delete(key)

    # -- inspection (cudabuild.engine.cache_admin, explain): none of it counts as a use -----------

    def entries(self, prefix: str) -> list[Entry]:
        """Every entry whose key starts with `prefix` ("blob:", "rec:", ...), with its size and times."""
        return entries(self.cache, prefix)

    def sizes(self, keys: list[str]) -> dict[str, int]:
        return sizes(self.cache, keys)

    def usage(self) -> dict[str, tuple[int, int]]:
        """{key prefix ("blob", "rec", "stat", "doc", "log"): (entries, bytes)}."""
        return usage(self.cache)

    def size(self) -> int:
        """Bytes held in blobs and records: what a size limit (gc, CUDABUILD_CACHE_MAX_SIZE) bounds."""
        held = self.usage()
        return sum(held.get(kind, (0, 0))[1] for kind in ("blob", "rec", "spans"))

    def orphan_files(self, min_age_s: float = ORPHAN_MIN_AGE_S, now: Optional[float] = None) -> list[tuple[Path, int]]:
        """Value files that no row names, as (path, bytes); what sweep_orphans deletes.

        A writer killed after diskcache wrote a blob's file and before its row committed leaves such
        a file: never served, but it holds disk until someone deletes it. Only files untouched for
        `min_age_s` count, so a write still in progress (file first, row a moment later) is left be.
        """
        now = time.time() if now is None else now
        found = []
        for path in unnamed_files(self.cache):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another sweep got there first
                continue
            if stat.st_mtime <= now - min_age_s:
                found.append((path, stat.st_size))
        return found

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

    def close(self) -> None:
        self.cache.close()


def _unwritable(root: Path, doing: str, error: BaseException) -> str:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    with contextlib.suppress(OSError):
        if shutil.disk_usage(root).free < 1 << 20:  # SQLite says "disk I/O error" when it cannot grow
            reason = f"its disk is full ({reason})"
    return (f"cannot write to the cache at {root} while {doing}: {reason}; free space there "
            f"(cudabuild cache gc --max-size SIZE) or set CUDABUILD_CACHE_DIR to a disk with room")

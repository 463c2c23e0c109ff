"""What cudabuild reads from diskcache below its public API: the `Cache` table's rows and the layout of
its value files. Everything that uses `cache._sql`, `cache._disk`, `cache.directory` or the
`*/*/*.val` layout lives here, so that a diskcache upgrade that changes them breaks this module
only (pyproject.toml pins the diskcache versions it was tested with).

Why go below the API at all: a public read (`Cache.get`) moves the entry's access_time, which
least-recently-used eviction orders by, so looking at the store (explain, `cudabuild cache ...`)
would count as using it; and `Cache.get` cannot tell a missing row from a row whose file is gone.

Rows here are the ones Store writes: keys are str (`raw = 1` in diskcache's terms). This module
knows nothing of blobs or records beyond their key prefixes; store.py gives the rows their meaning.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import diskcache

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

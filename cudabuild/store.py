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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import diskcache

from .errors import CorruptBlob, MissingBlob
from .hashing import CHUNK, FileHasher, sha256_file

# diskcache culls past size_limit on every write; cudabuild evicts by its own rules (gc keeps what
# build/ references), so the limit is set beyond reach. LRU policy keeps access times up to date.
_NEVER_CULL = 2**62


def default_root() -> Path:
    return Path(os.environ.get("CUDABUILD_CACHE_DIR") or Path.home() / ".cache" / "cudabuild")


class Store:
    def __init__(self, root: os.PathLike | str | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache = diskcache.Cache(
            str(self.root / "store"),
            size_limit=_NEVER_CULL,
            eviction_policy="least-recently-used",
            timeout=60,
        )
        self.hasher = FileHasher(self.cache)
        # A second tier (issue: shared Redis cache) plugs in here; None means local only.
        self.remote = None

    # -- blobs ---------------------------------------------------------------------------------

    def has_blob(self, sha: str) -> bool:
        return ("blob:" + sha) in self.cache

    def put_file(self, path: os.PathLike | str, sha: Optional[str] = None) -> str:
        """Store a file's bytes under their sha256 (once: an existing blob is not rewritten)."""
        sha = sha or sha256_file(path)
        if not self.has_blob(sha):
            with open(path, "rb") as f:
                self.cache.set("blob:" + sha, f, read=True)
        return sha

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha):
            self.cache.set("blob:" + sha, io.BytesIO(data), read=True)
        return sha

    @contextlib.contextmanager
    def _open_blob(self, sha: str) -> Iterator[io.BufferedReader]:
        handle = self.cache.get("blob:" + sha, read=True)
        if handle is None:
            raise MissingBlob(f"blob {sha[:12]} is not in the cache at {self.root}")
        try:
            yield handle
        finally:
            handle.close()

    def fetch(self, sha: str, dest: os.PathLike | str) -> Path:
        """Copy a blob to `dest` atomically, verifying its hash; a corrupt blob is dropped."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix="." + dest.name + ".")
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, self._open_blob(sha) as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != sha:
                self.drop_blob(sha)
                raise CorruptBlob(f"cached blob {sha[:12]} for {dest.name} failed its sha256 check; dropped, it will be rebuilt")
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest

    def read_bytes(self, sha: str) -> bytes:
        with self._open_blob(sha) as src:
            data = src.read()
        if hashlib.sha256(data).hexdigest() != sha:
            self.drop_blob(sha)
            raise CorruptBlob(f"cached blob {sha[:12]} failed its sha256 check; dropped, it will be rebuilt")
        return data

    def verify_blob(self, sha: str) -> bool:
        """Re-hash one blob; drop it and return False when it is corrupt or unreadable."""
        try:
            h = hashlib.sha256()
            with self._open_blob(sha) as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
        except (MissingBlob, OSError):
            self.drop_blob(sha)
            return False
        if h.hexdigest() != sha:
            self.drop_blob(sha)
            return False
        return True

    def drop_blob(self, sha: str) -> None:
        self.cache.delete("blob:" + sha)

    def blob_path(self, sha: str) -> Optional[Path]:
        """Where diskcache keeps a blob's file (for tests that damage it on purpose)."""
        with self._open_blob(sha) as handle:
            return Path(handle.name)

    # -- action records ------------------------------------------------------------------------

    def get_record(self, key: str) -> Optional[dict]:
        """The record for an action key, only if every blob it names is present."""
        raw = self.cache.get("rec:" + key)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            self.drop_record(key)
            return None
        if not all(self.has_blob(sha) for sha in record.get("outputs", {}).values()):
            return None
        return record

    def put_record(self, key: str, record: dict) -> None:
        record = dict(record, created=record.get("created") or time.time())
        self.cache.set("rec:" + key, json.dumps(record, sort_keys=True))

    def drop_record(self, key: str) -> None:
        self.cache.delete("rec:" + key)

    # -- small JSON documents (recipe descriptions, logs) ---------------------------------------

    def get_json(self, name: str) -> Optional[dict]:
        raw = self.cache.get("doc:" + name)
        return json.loads(raw) if raw is not None else None

    def put_json(self, name: str, value: dict) -> None:
        self.cache.set("doc:" + name, json.dumps(value, sort_keys=True))

    # -- build log (what `cudabuild cache stats` summarises) ------------------------------------

    def record_build(self, manifest: dict) -> None:
        """Append one finished build's manifest (stages, statuses, seconds) to the log."""
        entry = {k: manifest[k] for k in ("model", "target", "stages", "outputs") if k in manifest}
        entry["time"] = time.time()
        self.cache.set(f"log:{entry['time']:017.6f}:{os.getpid()}", json.dumps(entry, sort_keys=True))

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

    def close(self) -> None:
        self.cache.close()

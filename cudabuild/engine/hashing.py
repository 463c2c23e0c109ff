"""Content digests: canonical JSON, files (streamed), and files memoised by their stat.

Keys are sha256 over canonical JSON (sorted keys, no whitespace), so the same inputs give the same
key on every machine and Python version. File hashes are memoised under (size, mtime_ns, inode,
path) so a no-op build reads no file twice and a 35B checkpoint is hashed once.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

CHUNK = 1 << 20


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def digest(value: Any) -> str:
    """sha256 of a JSON-able value's canonical form."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def sha256_file(path: os.PathLike | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stat_signature(path: os.PathLike | str) -> Optional[list]:
    """What identifies a file's content without reading it: None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


class FileHasher:
    """sha256 of files, memoised by stat signature in a persistent mapping (the store's memo table).

    `memo` is any mutable mapping with get/__setitem__ (a diskcache.Cache in practice); a file whose
    size, mtime or inode changed is read again.
    """

    def __init__(self, memo=None):
        self._memo = memo if memo is not None else {}

    def __call__(self, path: os.PathLike | str) -> Optional[str]:
        path = os.path.abspath(path)
        sig = stat_signature(path)
        if sig is None:
            return None
        key = "stat:" + path
        hit = self._memo.get(key)
        if hit and hit[0] == sig:
            return hit[1]
        value = sha256_file(path)
        self._memo[key] = (sig, value)
        return value

    def tree(self, root: os.PathLike | str, accept: Callable[[Path], bool] = lambda p: True) -> dict:
        """{relative path: sha256} for every regular file under root (sorted, hidden files skipped)."""
        root = Path(root)
        out = {}
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if any(part.startswith(".") for part in rel.parts) or not path.is_file() or not accept(path):
                continue
            out[str(rel)] = self(path)
        return out


def combine(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()

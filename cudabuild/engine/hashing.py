"""Content digests: canonical JSON, files (streamed), and files memoised by their stat.

Keys are sha256 over canonical JSON (sorted keys, no whitespace), so the same inputs give the same
key on every machine and Python version. File hashes are memoised under (size, mtime_ns, inode,
path) so a no-op build reads no file twice and a 35B checkpoint is hashed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tokenize
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


# Token kinds that carry no meaning: comments, blank lines, the encoding marker.
_UNMEANING = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.ENCODING})


def code_digest(path: os.PathLike | str) -> str:
    """sha256 of a Python file's tokens, without its comments and blank lines: the same for two
    versions of a file that differ only there, so a comment edit changes no key. Layout that has
    meaning (indentation, line breaks between statements) and docstrings are kept. A file that does
    not tokenize gets its bytes' sha256 (it then fails where it is imported, with its own error).
    """
    h = hashlib.sha256(b"python tokens v1\n")
    try:
        with open(path, "rb") as f:
            for token in tokenize.tokenize(f.readline):
                if token.type not in _UNMEANING:
                    h.update(f"{token.type} {token.string!r}\n".encode())
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return sha256_file(path)
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
        return self._memoised(path, "", sha256_file)

    def remember(self, path: os.PathLike | str, sha: str) -> None:
        """Record the sha256 of a file this process has just written from known content (an output
        copied into build/), so the next check does not read gigabytes to learn it."""
        path = os.path.abspath(path)
        sig = stat_signature(path)
        if sig is not None:
            self._remember(_memo_key("", path), (sig, sha))

    def remembered(self, path: os.PathLike | str) -> Optional[str]:
        """The sha256 the memo holds for the file as it is now (its stat signature), or None: the
        file is never read for it."""
        path = os.path.abspath(path)
        sig = stat_signature(path)
        if sig is None:
            return None
        try:
            hit = self._memo.get(_memo_key("", path))
        except (OSError, sqlite3.Error):  # as _memoised: a miss
            return None
        return hit[1] if hit and hit[0] == sig else None

    def derived(self, path: os.PathLike | str, tag: str, compute: Callable[[str], Any]) -> Any:
        """`compute(path)`, a value read off the file's content (`tag` names which), memoised like
        the file's hash: under its stat signature, so it is computed once per change of the file."""
        return self._memoised(path, tag, compute)

    def _memoised(self, path: os.PathLike | str, tag: str, compute: Callable[[str], Any]) -> Any:
        path = os.path.abspath(path)
        sig = stat_signature(path)
        if sig is None:
            return None
        key = _memo_key(tag, path)
        try:
            hit = self._memo.get(key)
        except (OSError, sqlite3.Error):  # a read that cannot update the entry's access time (a full disk): a miss
            hit = None
        if hit and hit[0] == sig:
            return hit[1]
        value = compute(path)
        self._remember(key, (sig, value))
        return value

    def _remember(self, key: str, entry) -> None:
        # The memo is an optimisation: one that cannot be written (a full disk, a read-only cache)
        # costs a second read later, never the build. The store reports its own write failures.
        try:
            self._memo[key] = entry
        except (OSError, sqlite3.Error):
            pass

    def tree(self, root: os.PathLike | str, accept: Callable[[Path], bool] = lambda p: True,
             parts: Optional[dict[str, Callable[[str], dict]]] = None, tag: str = "parts") -> dict:
        """{relative path: sha256} for every regular file under root (sorted, hidden files skipped).

        A file whose suffix `parts` names is given by that function's digests of its parts
        ({part: sha256}) instead, so that a change can be told part by part; `tag` names what the
        function reads off the file, for the memo (a file's parts' content, or their layout).
        """
        root = Path(root)
        parts = parts or {}
        out = {}
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if any(part.startswith(".") for part in rel.parts) or not path.is_file() or not accept(path):
                continue
            split = parts.get(path.suffix)
            out[str(rel)] = self.derived(path, tag + path.suffix, split) if split else self(path)
        return out


def _memo_key(tag: str, path: str) -> str:
    return f"stat:{tag}:{path}" if tag else "stat:" + path  # a file's own hash: "stat:<path>"


def combine(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()

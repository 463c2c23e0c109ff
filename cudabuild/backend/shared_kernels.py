"""Compiled Triton kernels shared through the remote tier, so a second machine compiles no kernel
the first one compiled.

Triton looks compiled kernels up through a cache manager class that `TRITON_CACHE_MANAGER` names
(module:Class). `SharedKernels` is that class: Triton's own `FileCacheManager` on the kernel cache
folder (cudabuild.backend.kernel_cache), which, on a local miss, asks the tier and, when Triton
stores a newly compiled kernel, publishes it there. Triton keys a kernel by its source, options,
device and versions, so the tier's entry for a key is that kernel wherever it was compiled.

On the tier, a kernel is an action record (records.well_formed: plain file names -> sha256) under
sha256("triton-kernel:<triton key>:<group file>"), its files as blobs: signed, checked and
degraded as every record and blob is (tiers.base), and `cache gc --remote` ages it like any other.
The group file Triton keeps locally names absolute paths; the record names files only, and a
fetched kernel is written through Triton's own `put`, atomically, before its group.

Triton compiles in inductor's worker processes too; each process builds its own tier from the
CUDABUILD_REMOTE* variables it inherits (`factory.from_env`), once. This module imports Triton,
so only Triton imports it (through the variable kernel_cache.environment sets).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from triton.runtime.cache import FileCacheManager

from cudabuild.engine.hashing import digest, sha256_file
from cudabuild.engine.console import terminal
from cudabuild.engine.tiers import factory

_TIERS: dict[int, object] = {}  # pid -> this process's tier (None: no remote, or a bad setting)


def _tier():
    pid = os.getpid()
    if pid not in _TIERS:
        try:
            _TIERS[pid] = factory.from_env(os.environ, warn=terminal.warn)
        except Exception:  # a bad setting is the build's to report (it reads the same variables)
            _TIERS[pid] = None
    return _TIERS[pid]


def record_key(triton_key: str, group: str) -> str:
    return hashlib.sha256(f"triton-kernel:{triton_key}:{group}".encode()).hexdigest()


class SharedKernels(FileCacheManager):
    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._shared = not (override or dump)  # Triton's override and dump folders stay local

    def get_group(self, filename):
        found = super().get_group(filename)
        if found is not None or not self._shared or (tier := _tier()) is None:
            return found
        record = tier.get_record(record_key(self.key, filename))
        if not record or not record.get("outputs"):
            return None
        paths = {}
        with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix="tmp.fetch_") as folder:
            for name, sha in sorted(record["outputs"].items()):
                arrived = Path(folder) / name
                if not tier.get_blob_to_file(sha, arrived):  # a blob that does not hash to sha is never kept
                    return None
                paths[name] = self.put(arrived.read_bytes(), name)
        super().put_group(filename, paths)
        return paths

    def put_group(self, filename, group):
        written = super().put_group(filename, group)
        tier = _tier() if self._shared else None
        if tier is None or not tier.writable:
            return written
        outputs = {}
        for name, path in sorted(group.items()):
            sha = sha256_file(path)
            with open(path, "rb") as source:
                if not tier.put_blob(sha, source):
                    return written  # every blob first, the record last: nothing half-published
            outputs[name] = sha
        tier.put_record(record_key(self.key, filename),
                        {"stage": "triton kernel", "digest": digest(outputs), "outputs": outputs})
        return written

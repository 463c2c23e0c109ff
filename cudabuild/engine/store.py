"""A cache folder opened: its diskcache table, the object store and the action cache kept in it,
and the shared tier behind both.

Layout of `$CUDABUILD_CACHE_DIR` (default `~/.cache/cudabuild`):
- `store/`: one diskcache table (cudabuild.engine.diskcache_rows.Table) holding the object
  store's blobs (`blob:`, `spans:`, `range:`: cudabuild.engine.object_store), the action cache's
  records, documents and build log (`rec:`, `doc:`, `log:`: cudabuild.engine.action_cache), and
  the file-hash memo (`stat:`: cudabuild.engine.hashing.FileHasher);
- `spans/`, `incoming/`, `work/`, `locks/`: the object store's materialized spans, blobs on their
  way in from the shared tier, the stages' work folders, and the build locks;
- any other folder: one a stage's tools keep beside the store (compiled kernels), gc'd with it.

With $CUDABUILD_REMOTE set, a shared tier (cudabuild.engine.tiers) sits behind this one: a record or
blob missing here is looked up there and copied in, and a new record is written back, its blobs
first. Without it, cudabuild.engine.tiers is never imported.

Owns opening and closing a cache folder, and which shared tier is behind it. Must not touch: what
is kept in it (the object store's and the action cache's), what is in use (cache_admin, above),
or anything that imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from cudabuild.engine.action_cache import ActionCache
from cudabuild.engine.console import terminal
from cudabuild.engine.diskcache_rows import Table
from cudabuild.engine.hashing import FileHasher
from cudabuild.engine.object_store import ObjectStore


def default_root() -> Path:
    return Path(os.environ.get("CUDABUILD_CACHE_DIR") or Path.home() / ".cache" / "cudabuild")


def remote_from_env():
    """The shared tier $CUDABUILD_REMOTE names, or None; connects to nothing until first used."""
    if not any(os.environ.get(name, "").strip() for name in ("CUDABUILD_REMOTE", "CUDABUILD_REMOTE_BLOBS")):
        return None
    from cudabuild.engine.tiers.factory import from_env  # only builds that name a remote tier import it (and, later, redis)

    return from_env(warn=terminal.warn)  # the terminal's stderr, also while a stage's output goes to its log


_FROM_ENV = object()


class Store:
    """The cache at `root` (default: default_root()): `table`, `objects` (blobs), `actions`
    (records, documents, the build log), `hasher` (the file-hash memo) and `remote` (the shared
    tier, a cudabuild.engine.tiers Tier; None means local only; by default the one
    $CUDABUILD_REMOTE names)."""

    def __init__(self, root: os.PathLike | str | None = None, remote=_FROM_ENV):
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.table = Table(self.root)
        self.hasher = FileHasher(self.table.cache)
        self.remote = remote_from_env() if remote is _FROM_ENV else remote
        self.objects = ObjectStore(self.table, self.hasher, self.remote)
        self.actions = ActionCache(self.table, self.objects, self.remote)

    def close(self) -> None:
        self.table.close()

"""The shared cache of compiled Triton kernels: Triton's own on-disk cache, kept in the cudabuild
cache instead of each compile's private (emptied) inductor dir.

Triton keys a compiled kernel by its source, its compile options (warps, stages), the device's
target and the versions of Triton and its backend: content, not where it was compiled. So a kernel
that did not change between two compiles (the other method's, the build before a spec change, an
eager run in verify of the same Triton op) is not compiled again, and what a hit returns is what a
miss would build. Triton writes each entry to a temporary name and renames it into place, so
builds that share the folder cannot see half an entry.

`$CUDABUILD_KERNEL_CACHE` names another folder (caches of one machine can share one); a
`TRITON_CACHE_DIR` the user set wins over both. With a remote tier ($CUDABUILD_REMOTE), Triton's
cache manager is cudabuild.backend.shared_kernels.SharedKernels, which shares the kernels through
the tier (a `TRITON_CACHE_MANAGER` the user set wins), and inductor's own autotune cache is
pointed at the shared Redis (`remote_autotune_environment`).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from cudabuild.engine.tiers.base import MODE_ENV, REMOTE_ENV

ENV = "CUDABUILD_KERNEL_CACHE"
SHARED_MANAGER = "cudabuild.backend.shared_kernels:SharedKernels"


def triton_dir(store_root: os.PathLike | str, environ=os.environ) -> Path:
    return Path(environ.get(ENV) or Path(store_root) / "kernels") / "triton"


def environment(store_root: os.PathLike | str, environ=os.environ) -> dict[str, str]:
    """What points Triton at the shared folder, or nothing where the user points it elsewhere."""
    env = {}
    if not environ.get("TRITON_CACHE_DIR"):
        env["TRITON_CACHE_DIR"] = str(triton_dir(store_root, environ))
    if environ.get("CUDABUILD_REMOTE", "").strip() and not environ.get("TRITON_CACHE_MANAGER"):
        env["TRITON_CACHE_MANAGER"] = SHARED_MANAGER
    return env


def entries(store_root: os.PathLike | str, environ=os.environ) -> set[str]:
    """The kernels in the folder now (one entry per compiled kernel): a compile that adds entries
    compiled those kernels, one that adds none found every kernel compiled already."""
    try:
        folder = environ.get("TRITON_CACHE_DIR") or triton_dir(store_root, environ)
        return {name for name in os.listdir(folder) if not name.startswith(".")}
    except OSError:
        return set()


def remote_autotune_environment(environ=os.environ) -> dict[str, str]:
    """Variables that point inductor's own remote autotune cache at the shared Redis.

    Empty unless $CUDABUILD_REMOTE is a redis:// URL and the mode lets this builder write (inductor
    cannot be made read-only). Inductor reads TORCHINDUCTOR_REDIS_URL first (it keeps the DB
    number), else HOST and PORT. torch/_inductor/config.py reads TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE
    once, at import, so the compile stage also patches `autotune_remote_cache` while it compiles.
    """
    url = environ.get(REMOTE_ENV, "").strip()
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or (environ.get(MODE_ENV, "").strip() == "read-only"):
        return {}
    return {
        "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_REDIS_URL": url,
        "TORCHINDUCTOR_REDIS_HOST": parts.hostname or "localhost",
        "TORCHINDUCTOR_REDIS_PORT": str(parts.port or 6379),
    }

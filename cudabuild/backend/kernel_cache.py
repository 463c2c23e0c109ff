"""The shared cache of compiled Triton kernels: Triton's own on-disk cache, kept in the cudabuild
cache instead of each compile's private (emptied) inductor dir.

Triton keys a compiled kernel by its source, its compile options (warps, stages), the device's
target and the versions of Triton and its backend: content, not where it was compiled. So a kernel
that did not change between two compiles (the other method's, the build before a spec change, an
eager run in verify of the same Triton op) is not compiled again, and what a hit returns is what a
miss would build. Triton writes each entry to a temporary name and renames it into place, so
builds that share the folder cannot see half an entry.

`$CUDABUILD_KERNEL_CACHE` names another folder (caches of one machine can share one); a
`TRITON_CACHE_DIR` the user set wins over both.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "CUDABUILD_KERNEL_CACHE"


def triton_dir(store_root: os.PathLike | str, environ=os.environ) -> Path:
    return Path(environ.get(ENV) or Path(store_root) / "kernels") / "triton"


def environment(store_root: os.PathLike | str, environ=os.environ) -> dict[str, str]:
    """What points Triton at the shared folder, or nothing where the user points it elsewhere."""
    if environ.get("TRITON_CACHE_DIR"):
        return {}
    return {"TRITON_CACHE_DIR": str(triton_dir(store_root, environ))}

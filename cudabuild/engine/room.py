"""Whether a build's outputs fit the disks they go to, asked before its first stage.

A first build of a big model that runs out of disk does so after many minutes, in whichever
stage writes last (a 35B MoE at 40 layers once died 757 s in, in AOTInductor's write of its
weights blob, with doit's database failing beside it). Its need can be projected from the
options alone: the weights as the build keeps them (the recipe's `weights_bytes`, a quantized
bundle) are on the disk twice at the end, once in the cache and once in build/'s .ptd (every other
stage's copy of them is kept as ranges of the cached one: cudabuild.engine.spans), with WORKING
of them besides while the stages run, in the cache's work folders. A build that cannot fit is
refused in one line that names the need, the room, and where to point the cache.

Also here: `disk_full`, which tells a full disk in whatever a stage raised (an OSError, or a
library's error that wraps one, as inductor's does), and `named`, which the runner puts around each
stage, so every stage names it the same way, wherever in the stage (its run, the storing of what
it made, the bookkeeping around both) the disk filled.

Owns the projection and the check. Must not touch: what the weights are (the recipe says).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.errors import CacheUnwritable, CudabuildError

# Of the weights' bytes, what the stages' work files and temporaries hold at most beside the
# cache and build/ (one tensor file, one compile's inductor folder, a blob's glue at a time).
WORKING = 0.2
MARGIN = 1 << 30


class NoRoom(CudabuildError):
    """The build's projected disk need is more than the free space where its outputs go."""


class DiskFull(CudabuildError):
    """A stage met a full disk."""


def _device(path: Path) -> int:
    """The filesystem `path` is on (its nearest existing folder's)."""
    while not path.exists():
        path = path.parent
    return os.stat(path).st_dev


def _free(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check(weights_bytes: Optional[int], cache: Path, build: Path, what: str, weights_cached: bool = False) -> None:
    """Refuse (NoRoom) a build whose weights take `weights_bytes` when the disks of the cache and
    of build/ cannot hold them as the build keeps them (the module docstring); `what` names the
    build in the message. With `weights_cached` (the cache holds them already), build/ alone."""
    if not weights_bytes:
        return
    needs = {cache: 0 if weights_cached else int(weights_bytes * (1 + WORKING)) + MARGIN, build: int(weights_bytes)}
    by_disk: dict[int, list[Path]] = {}
    for place in needs:
        by_disk.setdefault(_device(place), []).append(place)
    for places in by_disk.values():
        need, free = sum(needs[p] for p in places), _free(places[0])
        if need > free:
            where = " and ".join(str(p) for p in places)
            raise NoRoom(f"{what} needs about {_gb(need)} of disk at {where} (its weights, {_gb(weights_bytes)}, once "
                         f"in the cache and once in build/'s .ptd, and room to work), and it has {_gb(free)} free",
                         fix="free space there, or set CUDABUILD_CACHE_DIR (the cache and the stages' work folders) "
                             "to a disk with room")


def disk_full(error: BaseException, cache: Optional[Path] = None) -> Optional[OSError]:
    """The full-disk OSError behind `error` (it, its cause or context, or a wrapped one whose
    message says `[Errno 28]`), or None. Some writers say no errno (torch.save: "unexpected pos"):
    with `cache`, a disk there with less than 1 MiB free is taken for the cause too."""
    seen, first = set(), error
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return error
        if "[Errno 28]" in str(error) or "No space left on device" in str(error):
            return OSError(errno.ENOSPC, "No space left on device")
        error = error.__cause__ or error.__context__
    if cache is not None and isinstance(first, (OSError, RuntimeError)):
        try:
            if _free(cache) < 1 << 20:
                return OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            pass
    return None


def full_disk_error(stage: str, error: OSError, cache: Path, build: Optional[Path] = None) -> DiskFull:
    """The one line every stage that meets a full disk says: the cache's writer's words
    (cudabuild.engine.diskcache_rows), naming the disk that filled. Of the paths the error names (a move
    names its source and its destination), one on the cache's disk is the cache's; else one in
    `build` (build/<model>/<target>) is build/'s; else the last one's folder, a compile's."""
    paths = [Path(os.fsdecode(p)) for p in (getattr(error, "filename", None), getattr(error, "filename2", None))
             if isinstance(p, (str, bytes, os.PathLike))]
    where, fix = f"the cache at {cache}", "free space there (cudabuild cache gc --max-size SIZE) or set CUDABUILD_CACHE_DIR to a disk with room"
    if paths and not any(_device(p) == _device(cache) for p in paths):
        inside = [p for p in paths if build is not None and p.is_relative_to(build)]
        if inside:
            where, fix = f"build/ at {build}", "free space there, or build the project on a disk with room"
        else:
            where = str(paths[-1].parent)
            fix = "free space there, or set CUDABUILD_INDUCTOR_DIR (the compiles' folders) to a disk with room"
    return DiskFull(f"cannot write to {where} while running stage {stage}",
                    f"its disk is full ({error.strerror or 'No space left on device'})", fix=fix)


def said(error: BaseException) -> Optional[CudabuildError]:
    """A full disk already said in the project's words in `error`'s chain (its cause or context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (DiskFull, CacheUnwritable)):
            return error
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def named(stage: str, cache: Path, build: Optional[Path] = None) -> Iterator[None]:
    """A full disk met anywhere in the block (the stage, the storing of what it made, the
    bookkeeping around it) raised as the one line every stage says (full_disk_error). Where one was
    said already and the unwinding met the full disk again (a ledger's or a log's write on the
    same disk), the first one is what the user reads."""
    try:
        yield
    except Exception as e:
        first = said(e)
        if first is not None:
            if first is e:
                raise
            raise type(first)(str(first)) from e
        full = disk_full(e, cache)
        if full is None:
            raise
        raise full_disk_error(stage, full, cache, build) from e

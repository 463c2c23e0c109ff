"""cudabuild.engine.room's full-disk words: which disk a full-disk error names, and that the first
one said is what a user reads when the unwinding meets the full disk again. (The projection and
its check are tested in tests/test_disk_peak.py; a real tmpfs filled under a build, end to end, in
tests/test_hardening.py.)"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cudabuild.engine import room
from cudabuild.errors import CacheUnwritable

OTHER_DISK = Path("/dev/shm")  # a tmpfs on Linux: another filesystem than pytest's tmp_path


def _full(*paths) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", *paths)


@pytest.fixture
def other_disk(tmp_path):
    if not OTHER_DISK.is_dir() or os.stat(OTHER_DISK).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip(f"{OTHER_DISK} is not another filesystem than {tmp_path} here")
    return OTHER_DISK


def test_a_move_into_the_cache_that_fills_its_disk_names_the_cache_not_the_source(tmp_path, other_disk):
    """shutil.move of a compiled .so from inductor's folder (another disk) into the stage's work
    folder names both paths; the full one is the destination, in the cache (issue 59: it named the
    inductor folder, and told the user to move that)."""
    cache = tmp_path / "cache"
    error = _full(str(other_disk / "inductor" / "x.wrapper.so"), None, str(cache / "work" / "compile.prefill-1-x" / "model.so"))
    line = str(room.full_disk_error("compile.prefill", error, cache))
    assert line == (f"cannot write to the cache at {cache} while running stage compile.prefill: its disk is full (No "
                    "space left on device); free space there (cudabuild cache gc --max-size SIZE) or set "
                    "CUDABUILD_CACHE_DIR to a disk with room")


def test_a_full_disk_elsewhere_names_that_folder_and_build_s_own_disk_names_build(tmp_path, other_disk):
    cache, build = other_disk / "cache", tmp_path / "build" / "m" / "cpu"
    compiles = room.full_disk_error("compile.decode", _full(str(tmp_path / "inductor" / "k" / "x.o")), cache, build)
    assert str(compiles).startswith(f"cannot write to {tmp_path / 'inductor' / 'k'} while running stage compile.decode")
    assert "set CUDABUILD_INDUCTOR_DIR" in str(compiles)
    restoring = room.full_disk_error("package", _full(str(build / "model.pte")), cache, build)
    assert str(restoring).startswith(f"cannot write to build/ at {build} while running stage package: its disk is full")


def test_the_first_full_disk_said_is_what_the_user_reads(tmp_path):
    """A stage that met the full disk unwinds through bookkeeping on the same disk (the admission's
    ledger, a log), which fails again with a bare OSError: the stage's own line is kept."""
    cache = tmp_path / "cache"
    with pytest.raises(room.DiskFull) as said:
        with room.named("compile.prefill", cache):
            try:
                with room.named("compile.prefill", cache):
                    raise _full(str(cache / "work" / "model.so"))
            finally:
                raise _full()  # the ledger's write, on the way out
    assert str(said.value).startswith(f"cannot write to the cache at {cache} while running stage compile.prefill")
    # The cache's own writer's words are kept as they are.
    with pytest.raises(CacheUnwritable, match="while storing model.so"):
        with room.named("blob.decode", cache):
            try:
                raise CacheUnwritable(f"cannot write to the cache at {cache} while storing model.so: its disk is full")
            finally:
                raise _full()
    # Anything else passes through unchanged.
    with pytest.raises(ValueError, match="^not a disk$"):
        with room.named("export.decode", cache):
            raise ValueError("not a disk")

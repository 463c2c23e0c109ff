"""Writing files so that a reader (another build, a kill mid-write) sees the old content or the
new, never part of it: write a temporary file beside the destination, then rename it over.

The file gets the mode a plain `open(path, "w")` would give it (0666 less the umask, typically
0644), not mkstemp's private 0600: build outputs and manifests are read by other people and tools.

Also here: `temporary_file`, a scratch file that is always deleted, for bytes on their way
somewhere else (a blob downloaded from the remote tier, checked, then stored).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


def _process_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_process_umask()


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[str]:
    """A temporary file beside `path`: renamed over it when the block ends, deleted on error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a temporary file beside `path`, then put it in place."""
    with _replacing(path) as tmp, open(tmp, "wb") as f:
        write(f)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_copy(src: Path, dest: Path) -> None:
    with _replacing(dest) as tmp:
        shutil.copyfile(src, tmp)  # sendfile where it can: build outputs run to gigabytes


@contextlib.contextmanager
def temporary_file(directory: Path, prefix: str = "") -> Iterator[Path]:
    """An empty file of its own in `directory`, deleted when the block ends, however it ends.

    For content that is written, read back, and kept elsewhere: it streams through the disk, so a
    download of gigabytes never has to fit in memory.
    """
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix)
    os.close(fd)
    try:
        yield Path(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)

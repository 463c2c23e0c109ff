"""Writing files so that a reader (another build, a kill mid-write) sees the old content or the
new, never part of it: write a temporary file beside the destination, then rename it over.

The file gets the mode a plain `open(path, "w")` would give it (0666 less the umask, typically
0644), not mkstemp's private 0600: build outputs and manifests are read by other people and tools.

Also here: `temporary_file`, a scratch file that is always deleted, for bytes on their way
somewhere else (a blob downloaded from the remote tier, checked, then stored); and `clone_file`,
the cheapest copy that shares no writable storage with its source.

Why outputs in build/ are never hard links into the store, though that would be cheaper still: a
link shares the inode, so a user who truncates or edits build/.../model.ptd in place would change
the cached blob too; a read-only mode does not prevent that for root, nor for tools that chmod
before writing. A reflink (FICLONE) shares the extents copy-on-write: a write to either file
leaves the other as it was, so it is as safe as a copy, and free where the filesystem has it (XFS,
Btrfs, bcachefs, ZFS 2.2+). Elsewhere (ext4, tmpfs) the kernel copies (copy_file_range), without
the bytes passing through this process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
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


def atomic_copy(src: Path, dest: Path) -> str:
    """Copy src over dest atomically, by `clone_file`; returns how ("reflink" or "copy")."""
    with _replacing(dest) as tmp:
        return clone_file(src, Path(tmp))


def move_or_copy(src: Path, dest: Path) -> str:
    """Put src's file at dest atomically: renamed where both are on one filesystem (src is gone
    then), else copied (atomic_copy). Returns "moved", "reflink" or "copy"."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(src, FILE_MODE)
        os.replace(src, dest)
        return "moved"
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    return atomic_copy(src, dest)


FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# Errors that mean "this filesystem (or pair of them) cannot share extents": copy instead.
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}


def clone_file(src: Path, dest: Path) -> str:
    """Make dest (created or truncated) a copy of src: a reflink where the filesystem shares
    extents copy-on-write, else an in-kernel copy. Returns "reflink" or "copy"."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return "reflink"
        except OSError as e:
            if e.errno not in _NO_REFLINK:
                raise
        size = os.fstat(fin.fileno()).st_size
        # As cp does: a sequential read gets twice the readahead, and with it fewer seeks between
        # the reads and the writes of a copy on one disk (at 8.8 GB: 33 s without, 21 s with).
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        copied = 0
        try:
            while copied < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - copied)
                if n == 0:
                    break
                copied += n
        except OSError as e:
            if e.errno not in _NO_REFLINK or copied:
                raise
            shutil.copyfileobj(fin, fout, 1 << 20)  # a kernel without copy_file_range for this pair
        return "copy"


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

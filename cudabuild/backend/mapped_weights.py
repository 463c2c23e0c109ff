"""Weights mapped from the store, handed back to the page cache once AOTInductor has copied them.

The compile stage maps the edge program's weights from the store's files (programs.load_program)
instead of reading them into memory. AOTInductor then copies every constant into one buffer, the
weights blob, with `ctypes.memmove` from a thread pool (torch/_inductor/codecache.py,
AotCodeCompiler.compile). Each mapped page it reads stays resident in the process, so at the end
of that copy the process holds the weights twice, once mapped and once in the blob: twice the
checkpoint's size, for a 35B model more than the machine has.

`released_after_copy` wraps `ctypes.memmove` for the duration of the compile: a copy whose source
lies inside one of the mapped weights is made in pieces of 32 MiB, and the whole pages of each
piece are dropped from the process as soon as it is copied (madvise MADV_DONTNEED), so what stays
resident is the blob, plus a piece per copying thread. Nothing is lost: the mapping is a private, read-only use of a
file in the store, so a dropped page is read back from the page cache or the file if touched
again. Copies from anywhere else pass through untouched.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
from typing import Iterable, Iterator

MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE
PIECE = 32 << 20  # bytes copied between two releases of the source's pages

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _drop_pages(address: int, length: int) -> None:
    """Drop the whole pages of [address, address + length) from this process's memory."""
    start = -(-address // PAGE) * PAGE
    end = (address + length) // PAGE * PAGE
    if end > start:
        _libc.madvise(start, end - start, MADV_DONTNEED)  # a refusal leaves the pages resident: harmless


class _Ranges:
    """Sorted, disjoint address ranges; `covers(a, n)` says whether [a, a + n) lies in one of them."""

    def __init__(self, spans: Iterable[tuple[int, int]]):
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def covers(self, address: int, length: int) -> bool:
        i = bisect.bisect_right(self.starts, address) - 1
        return i >= 0 and address + length <= self.ends[i]


class Mapped:
    """The storage of file-mapped, never-written tensors, whose pages may be dropped at will.

    Only such memory may be dropped: MADV_DONTNEED on ordinary (anonymous) memory would zero it.
    """

    def __init__(self, tensors: Iterable):
        self.ranges = _Ranges(
            (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in tensors if t.numel()
        )

    def covers(self, address: int, length: int) -> bool:
        return self.ranges.covers(address, length)

    def drop(self, address: int, length: int) -> None:
        """Drop the whole pages of [address, address + length) if the range is mapped weights."""
        if self.covers(address, length):
            _drop_pages(address, length)

    def drop_all(self) -> None:
        for start, end in zip(self.ranges.starts, self.ranges.ends):
            _drop_pages(start, end - start)


@contextlib.contextmanager
def released_after_copy(tensors: Iterable) -> Iterator[None]:
    """Within the block, a `ctypes.memmove` out of any of these (file-mapped, never written)
    tensors' storage drops the source's pages from memory once it has copied them."""
    ranges = Mapped(tensors)
    original = ctypes.memmove

    def memmove(dst, src, count):  # called from inductor's thread pool: reads shared state only
        if not (isinstance(src, int) and isinstance(dst, int) and ranges.covers(src, count)):
            return original(dst, src, count)
        # A piece at a time, each piece's pages dropped as soon as it is copied: inductor copies a
        # whole constant per call (a gigabyte for an expert bank), from several threads at once.
        for done in range(0, count, PIECE):
            n = min(PIECE, count - done)
            original(dst + done, src + done, n)
            _drop_pages(src + done, n)
        return dst

    ctypes.memmove = memmove
    try:
        yield
    finally:
        ctypes.memmove = original

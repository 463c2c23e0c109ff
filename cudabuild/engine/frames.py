"""Where a stage's Python frames live: in a chunk of CPython's frame stack with room for all of them.

CPython 3.11 keeps a thread's Python frames in chunks of 16 KiB (`DATA_STACK_CHUNK_SIZE`), each one
mmap'ed when a call needs room past the last chunk and munmap'ed as soon as that call returns. A
loop whose calls cross a chunk's end maps and unmaps 16 KiB, and faults its pages in again, on
every call. Where the crossings fall depends on how deep the stage's caller was: one cold tiny_lm
build made 787,000 mmap calls of 16 KiB with its stages in `doit -n 1`'s worker process and 101,000
in doit's own (the plain lowering, 96,000), about 7 s of system time on 2 cores (2026-12-06, `perf
stat -e syscalls:sys_enter_mmap`): issue 54's one worker at 1.11 of the plain lowering.

`on_fresh_chunk(fn, ...)` calls `fn` from a frame so large that CPython opens a chunk of 1 MiB for
it, and `fn`'s frames follow in the half that is left: thousands of frames deep before a crossing,
whoever called it (doit's process, a doit worker, a warm process's fork, a cluster's worker). The
same build then made 5,800 mmap calls in all. Where frames live changes no result.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

# Local variables of the calling frame, 8 bytes each. CPython sizes a new chunk to the next power of
# two above (the frame + 1000 slots) x 8 bytes: 64,600 slots (517 KiB) open a chunk of 1 MiB, and
# leave 531 KiB after the frame for the stage's own, thousands of frames deep, so that a stage's
# calls never cross into another chunk.
PAD_SLOTS = 64_600


@functools.lru_cache(maxsize=None)
def _caller(slots: int) -> Callable[..., Any]:
    """A function whose frame has `slots` more local variables than its code uses (left unset)."""
    def call(fn, args, kwargs):
        return fn(*args, **kwargs)

    code = call.__code__
    names = code.co_varnames + tuple(f"_{i:x}" for i in range(slots))
    call.__code__ = code.replace(co_varnames=names, co_nlocals=len(names))
    return call


def on_fresh_chunk(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """fn(*args, **kwargs), its frames in a fresh chunk of the frame stack with room for thousands."""
    return _caller(PAD_SLOTS)(fn, args, kwargs)

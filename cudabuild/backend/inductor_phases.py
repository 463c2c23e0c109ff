"""Timeline spans for the parts of an AOTInductor compile that cost time: autotuning (each template
choice inductor selects by benchmark) and the C++ compile and link of the wrapper and kernels.

A scoped patch of two inductor entry points, `AlgorithmSelectorCache.__call__` and
`AotCodeCompiler.compile`, each wrapped in a `cudabuild.engine.console.trace.phase`; undone when the block ends,
also on error. Where this torch lacks one of them, that phase is just not shown: the timeline is a
diagnostic and must never fail a compile. Backend half.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from cudabuild.engine.console.trace import phase


def _entry_points() -> list[tuple[object, str, str]]:
    """(owner, attribute, span name) of each wrapped function this torch has."""
    found = []
    with contextlib.suppress(ImportError):
        from torch._inductor.select_algorithm import AlgorithmSelectorCache

        found.append((AlgorithmSelectorCache, "__call__", "autotune"))
    with contextlib.suppress(ImportError):
        from torch._inductor.codecache import AotCodeCompiler

        found.append((AotCodeCompiler, "compile", "C++ compile"))
    return [(owner, name, span) for owner, name, span in found if name in vars(owner)]


def _timed(function, span: str, bound_to_class: bool):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with phase(span, min_seconds=0.005):
            return function(*args, **kwargs)

    return classmethod(wrapper) if bound_to_class else wrapper


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Within the block, autotuning and the C++ compile appear as spans of the running stage."""
    originals = []
    for owner, name, span in _entry_points():
        raw = vars(owner)[name]
        is_classmethod = isinstance(raw, classmethod)
        function = raw.__func__ if is_classmethod else raw
        originals.append((owner, name, raw))
        setattr(owner, name, _timed(function, span, is_classmethod))
    try:
        yield
    finally:
        for owner, name, raw in reversed(originals):
            setattr(owner, name, raw)

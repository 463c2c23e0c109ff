"""cudabuild/engine/frames.py: a stage's calls never cross into a new chunk of CPython's frame stack,
whatever depth the stage was called from (a crossing maps, faults in and unmaps 16 KiB per call)."""

from __future__ import annotations

import resource
import sys

import pytest

from cudabuild.engine import frames


def _leaf():
    return 1


def _faults_of_calls_at(depth: int, calls: int = 2000) -> int:
    """Page faults while `calls` calls are made `depth` frames further down the stack."""
    if depth:
        return _faults_of_calls_at(depth - 1, calls)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        _leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _worst(depths=range(400)) -> int:
    return max(_faults_of_calls_at(depth) for depth in depths)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the chunk layout measured is CPython 3.11's")
def test_calls_at_any_depth_cross_no_chunk_inside_a_fresh_one():
    # Called plainly, some depth of the 400 puts the loop's calls across a chunk's end: a fault a call.
    assert _worst() >= 1000
    # From a fresh chunk, none does.
    assert frames.on_fresh_chunk(_worst) < 100


def test_it_passes_arguments_and_exceptions_through():
    assert frames.on_fresh_chunk(divmod, 7, 2) == (3, 1)
    assert frames.on_fresh_chunk(dict, a=1) == {"a": 1}
    with pytest.raises(ZeroDivisionError):
        frames.on_fresh_chunk(divmod, 1, 0)

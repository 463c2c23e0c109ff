"""memory.PeakSampler: the per-stage peak in the stamp and manifest, and the growth the runner
reads to decide whether a stage is worth a full garbage collection."""

from __future__ import annotations

import pytest

from cudabuild.engine.memory import PeakSampler, resident_bytes

MB = 1 << 20

pytestmark = pytest.mark.skipif(resident_bytes() is None, reason="needs /proc/self/statm")


def test_the_sampler_sees_what_a_block_holds_above_where_it_started():
    with PeakSampler(interval_s=0.01) as sampled:
        held = b"\x01" * (96 * MB)  # written, so resident (a zeroed allocation may not be)
    assert sampled.start is not None and sampled.peak >= sampled.start + 90 * MB
    assert sampled.grown() >= 90 * MB
    del held


def test_a_block_that_holds_nothing_new_has_not_grown_much():
    with PeakSampler(interval_s=0.01) as sampled:
        sum(range(1000))
    assert sampled.grown() < 16 * MB

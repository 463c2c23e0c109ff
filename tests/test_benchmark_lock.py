"""Two compiles may share one GPU; their kernel timings must not overlap. Inside
`timings_alone(lock)`, inductor's GPU benchmarks hold an exclusive flock on `lock`, which other
processes see, and which this process may take again while it holds it (inductor's benchmark
helpers call one another)."""

from __future__ import annotations

import subprocess
import sys

from cudabuild.backend import benchmark_lock

PROBE = """
import fcntl, sys
with open(sys.argv[1], "a+") as handle:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("held")
    else:
        print("free")
"""


def held_by_another_process(path) -> bool:
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "held"


def test_the_lock_is_seen_by_other_processes_and_reentrant_here(tmp_path):
    lock = benchmark_lock.ProcessLock(tmp_path / "locks" / "device-cuda.timing")
    with lock.held():
        with lock.held():  # taken again by this process: no wait on itself
            assert held_by_another_process(lock.lock_file)
        assert held_by_another_process(lock.lock_file)  # still held by the outer entry
    assert not held_by_another_process(lock.lock_file)


def test_inductors_gpu_benchmarks_hold_the_lock_within_the_block_only(tmp_path):
    from torch._inductor.runtime import benchmarking

    path = tmp_path / "device-cuda.timing"
    if not hasattr(benchmarking, "maybe_gpu_benchmark_lock"):
        import pytest

        pytest.skip("this torch has no benchmark lock hook (the wrapping path is tested below)")
    with benchmark_lock.timings_alone(path):
        with benchmarking.maybe_gpu_benchmark_lock():  # what inductor enters around each GPU timing
            assert held_by_another_process(path)
        assert not held_by_another_process(path)  # between timings, the other compile may time
    with benchmarking.maybe_gpu_benchmark_lock():
        assert not held_by_another_process(path)  # the hook is put back


def test_an_older_torchs_benchmarker_is_wrapped_for_the_block_and_put_back(tmp_path, monkeypatch):
    from torch._inductor.runtime import benchmarking

    monkeypatch.delattr(benchmarking, "set_gpu_benchmark_lock_context", raising=False)
    instance = benchmarking.benchmarker
    before = {name: getattr(type(instance), name, None) for name in benchmark_lock.GPU_ENTRY_POINTS}
    with benchmark_lock.timings_alone(tmp_path / "device-cuda.timing"):
        for name in benchmark_lock.GPU_ENTRY_POINTS:
            if before[name] is not None:
                assert getattr(instance, name).__wrapped__.__func__ is before[name]
    assert not set(benchmark_lock.GPU_ENTRY_POINTS) & set(vars(instance))
    seen = []
    wrapped = benchmark_lock._holding(lambda: seen.append(held_by_another_process(tmp_path / "l")),
                                      benchmark_lock.ProcessLock(tmp_path / "l"))
    wrapped()
    assert seen == [True] and not held_by_another_process(tmp_path / "l")

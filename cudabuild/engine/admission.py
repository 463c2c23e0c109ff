"""What a stage that runs asks for, and its turn: its memory estimate, its device, the admission
locks of this machine, and what it asks of a cluster's worker.

The estimate is the larger of its inputs' bytes (upstream outputs where its pipeline row says
memory_from_upstream, and the checkpoint when the stage is keyed on it) scaled by
workers.INPUT_FACTOR, and the peak its last run measured (its stamp's, a sibling method's, or the
newest logged build's) with workers.HISTORY_MARGIN. The rule that turns estimates into "beside
the others" or "alone", and the locks, are cudabuild.engine.workers'.

Owns reading those numbers off a runner's stamps, store and build log. Must not touch: whether a
stage runs (runner.py decides), or how (executors.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from cudabuild.engine import cluster, history, workers
from cudabuild.engine.console import trace
from cudabuild.engine.graph import Stage

# The trace's names of what a stage may wait for, each a span of its own (category "wait"),
# recorded whether it waited or not: its turn for memory beside the build's other stages, the
# device's lock, the key's lock (another process of this machine building the same key), the key's
# lease on the shared tier (another machine building it), a warm process to take its call.
WAITS = {"memory": "wait: memory admission", "device": "wait: device lock", "key": "wait: key lock",
         "lease": "wait: lease", "warm": "wait: warm process"}


@contextlib.contextmanager
def admitted(runner, stage: Stage, inputs: dict) -> Iterator[None]:
    """Run beside the build's other stages when they fit in memory together, else alone; and
    with the stage's device to itself (cudabuild.engine.workers). The memory lock is always
    taken first, so no two stages can wait on each other. One stage at a time takes none."""
    if runner.workers <= 1:
        yield
        return
    config = runner.config
    row = runner.pipeline.row(stage)
    alone_because = row.runs_alone(config, stage.method) if row.runs_alone else None
    device = row.device(config, stage.method) if row.device else None
    estimate = memory_estimate(runner, stage, inputs) if not alone_because else None
    admission = workers.admission(runner.workers, estimate, alone_because, workers.available_memory())
    locks = runner.store.root / "locks"
    on_device = workers.device_admission(runner.workers, last_device_peak(runner, stage),
                                         workers.free_device_memory(device),
                                         from_inputs=upstream_bytes(runner, stage)) if device else None
    with trace.phase("admitted", alone=admission.alone, why=admission.why, device=device or "",
                     device_alone=bool(on_device and on_device.alone),
                     device_why=on_device.why if on_device else ""), \
            contextlib.ExitStack() as held:
        with trace.wait(WAITS["memory"], alone=admission.alone):
            waited = held.enter_context(workers.admitted(locks / "stages", admission.alone))
        if device:
            with trace.wait(WAITS["device"], device=device, alone=on_device.alone):
                waited += held.enter_context(workers.admitted(workers.device_lock(locks, device), on_device.alone))
        if waited >= 1.0:
            runner.log(f"{stage.id}: waited {waited:.0f}s for its turn "
                       f"({admission.why}{f'; on {device}: {on_device.why}' if device else ''})")
        yield


def memory_estimate(runner, stage: Stage, inputs: dict) -> Optional[int]:
    """What the stage will hold at its peak, in bytes, or None when nothing says (see the module)."""
    config = runner.config
    read = upstream_bytes(runner, stage) if runner.pipeline.row(stage).memory_from_upstream else 0
    if inputs.get("checkpoint") and config.checkpoint:
        read += sum(f.stat().st_size for f in config.checkpoint.rglob("*") if f.is_file())
    from_inputs = int(read * workers.INPUT_FACTOR) + workers.PROCESS_BYTES if read else None
    last = last_peak(runner, stage)
    from_history = int(last * workers.HISTORY_MARGIN) if last else None
    known = [b for b in (from_inputs, from_history) if b is not None]
    return max(known) if known else None


def resources(runner, stage: Stage, inputs: dict) -> dict[str, float]:
    """What the stage asks of a cluster's worker: one of its row's device, and its memory estimate."""
    row = runner.pipeline.row(stage)
    device = row.device(runner.config, stage.method) if row.device else None
    return cluster.resources_for(device, memory_estimate(runner, stage, inputs))


def upstream_bytes(runner, stage: Stage) -> int:
    """The bytes of what the stages it depends on handed it (the program and its weights)."""
    shas = set()
    for upstream in runner.pipeline.dependencies(stage, runner.config):
        stamp = runner.read_stamp(upstream)
        if stamp is not None:
            shas.update(stamp.outputs.values())
    return runner.store.blob_bytes(shas)


def last_peak(runner, stage: Stage) -> Optional[int]:
    """The resident peak of the stage's last run: its stamp's, else that of the same stage of
    another method (the methods of one model hold the same weights: in a first build, the method
    exported first sizes the next), else the newest logged build of this model and target that ran it."""
    for candidate in _and_siblings(runner, stage):
        stamp = runner.read_stamp(candidate)
        if stamp is not None and stamp.status == "ran" and stamp.peak_rss:
            return int(stamp.peak_rss)
    return next((int(row["peak_rss"]) for row in history.logged_rows(runner, stage) if row.get("peak_rss")), None)


def last_device_peak(runner, stage: Stage) -> Optional[int]:
    """The device bytes the stage allocated at most in its last run (its value's peak_gpu_bytes),
    else those of the same stage of another method."""
    for candidate in _and_siblings(runner, stage):
        stamp = runner.read_stamp(candidate)
        peak = stamp.value.get("peak_gpu_bytes") if stamp is not None and isinstance(stamp.value, dict) else None
        if peak:
            return int(peak)
    return None


def _and_siblings(runner, stage: Stage) -> list[Stage]:
    """The stage, then the same stage of the model's other methods (which hold the same weights)."""
    return [stage] + [Stage(stage.kind, m) for m in runner.config.methods if stage.method and m != stage.method]

"""What a stage that runs asks for, and its turn: its memory estimate, its device, its
reservations of this machine's budgets, and what it asks of a cluster's worker.

The estimate is the larger of its inputs' bytes (the largest upstream stage's outputs, the
weights it is handed, where its pipeline row says memory_from_upstream, and the checkpoint when
the stage is keyed on it) scaled by workers.INPUT_FACTOR, and the peak its last run measured (its
stamp's, a sibling method's, or the newest logged build's) with workers.HISTORY_MARGIN. On a
device: its last measured peak, else its inputs' weights times its row's `device_factor`. The
budgets and the rule that admits by the sum of what is in flight are cudabuild.engine.workers'
and cudabuild.engine.ledger's.

Owns reading those numbers off a build's stamps, store and build log (a `BuildView`, or the
Runner, which reads the same way). Must not touch: whether a stage runs (runner.py decides), or
how (executors.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

from cudabuild.engine import cluster, history, ledger, workers
from cudabuild.errors import DeviceTooSmall
from cudabuild.engine.console import terminal, trace
from cudabuild.engine.graph import Build, Stage
from cudabuild.engine.stamp import Stamp, Stamps

# The trace's names of what a stage may wait for, each a span of its own (category "wait"),
# recorded whether it waited or not: its turn for memory beside the build's other stages, the
# device's lock, the key's lock (another process of this machine building the same key), the key's
# lease on the shared tier (another machine building it), a warm process to take its call.
WAITS = {"memory": "wait: memory admission", "device": "wait: device lock", "key": "wait: key lock",
         "lease": "wait: lease", "warm": "wait: warm process"}


@dataclasses.dataclass(frozen=True)
class BuildView:
    """What a stage's admission reads of its build: the build itself (its table, its options), its
    stamps, the cache (its blobs' sizes, its build log, its locks folder), how many stages it runs
    at once, and where its lines go. What an executor is handed in a Job, rather than the runner
    (which reads the same way)."""

    config: Build
    stamps: Stamps
    store: Any  # the build's cudabuild.engine.store.Store
    workers: int = 1
    log: Callable[[str], None] = terminal.note

    @property
    def pipeline(self):
        return self.config.pipeline

    def read_stamp(self, stage: Stage) -> Optional[Stamp]:
        return self.stamps.read(stage)


def device_of(build, stage: Stage) -> Optional[str]:
    """The device the stage runs on (its pipeline row's answer for this build), or None."""
    row = build.pipeline.row(stage)
    return row.device(build.config, stage.method) if row.device else None


@contextlib.contextmanager
def admitted(build, stage: Stage, inputs: dict) -> Iterator[None]:
    """Reserve the stage's memory from this machine's budget, and with a device its device
    memory from that device's (cudabuild.engine.ledger): in beside the build's other stages when
    the reservations in flight leave room for it, else once they do. The memory is always
    reserved first, so no two stages can wait on each other. One stage at a time reserves none."""
    config = build.config
    row = build.pipeline.row(stage)
    device = device_of(build, stage)
    if device:
        refuse_if_too_big(build, stage, device)
    if build.workers <= 1:
        yield
        return
    alone_because = row.runs_alone(config, stage.method) if row.runs_alone else None
    estimate = memory_estimate(build, stage, inputs) if not alone_because else None
    admission = workers.admission(build.workers, estimate, alone_because, workers.memory_budget())
    locks = build.store.root / "locks"
    on_device = device_budget = None
    if device:
        device_budget = workers.device_budget(device)
        factor = row.device_factor(config, stage.method) if row.device_factor else 1.0
        on_device = workers.device_admission(build.workers, last_device_peak(build, stage), device_budget,
                                             from_inputs=weights_bytes(build, stage), input_factor=factor)
    with trace.phase("admitted", alone=admission.alone, why=admission.why, device=device or "",
                     device_alone=bool(on_device and on_device.alone),
                     device_why=on_device.why if on_device else ""), \
            contextlib.ExitStack() as held:
        with trace.wait(WAITS["memory"], alone=admission.alone):
            waited = held.enter_context(ledger.reserved(workers.memory_ledger(locks), admission.need,
                                                        workers.memory_budget() or 0, stage.id))
        if device:
            with trace.wait(WAITS["device"], device=device, alone=on_device.alone):
                waited += held.enter_context(ledger.reserved(workers.device_ledger(locks, device), on_device.need,
                                                             device_budget or 0, stage.id))
        if waited >= 1.0:
            build.log(f"{stage.id}: waited {waited:.0f}s for its turn "
                       f"({admission.why}{f'; on {device}: {on_device.why}' if device else ''})")
        yield


def device_need(build, stage: Stage) -> Optional[tuple[int, str]]:
    """(bytes, basis) the stage will allocate on its device when it runs alone: its last measured
    peak (or a sibling method's), else its inputs' weights times its row's device factor, else the
    recipe's projection of the weights (Build.weights_bytes) times that factor; None where none
    says (a stage on no device, or of unknown size)."""
    config = build.config
    row = build.pipeline.row(stage)
    if not device_of(build, stage):
        return None
    measured = last_device_peak(build, stage)
    if measured:
        return measured, "measured in its last run"
    factor = row.device_factor(config, stage.method) if row.device_factor else 0.0
    if not factor:
        return None
    weights = weights_bytes(build, stage)
    if weights:
        return int(weights * factor), f"estimated as {factor:g}x the {weights / 2**30:.1f} GiB it is handed"
    if config.weights_bytes:
        return (int(config.weights_bytes * factor),
                f"projected as {factor:g}x the ~{config.weights_bytes / 2**30:.1f} GiB of weights these options give")
    return None


def device_preflight(build, capacity: Optional[int] = None) -> None:
    """Before a build's first stage: DeviceTooSmall for the first of its device stages that cannot
    fit the device alone (`capacity`, by default workers.device_capacity), by `device_need`. A
    stage whose size nothing says is left to its own admission."""
    for stage in build.pipeline.plan(build.config):
        device = device_of(build, stage)
        if device:
            refuse_if_too_big(build, stage, device, capacity)


def refuse_if_too_big(build, stage: Stage, device: str, capacity: Optional[int] = None) -> None:
    """DeviceTooSmall when the stage cannot fit its device even alone (`capacity`, by default
    workers.device_capacity): said before it starts, with its need and the room, instead of an
    out-of-memory error part way."""
    need = device_need(build, stage)
    capacity = workers.device_capacity(device) if capacity is None else capacity
    if need is not None and capacity is not None and need[0] > capacity:
        raise DeviceTooSmall(stage.id, device, need[0], capacity, need[1])


def memory_estimate(build, stage: Stage, inputs: dict) -> Optional[int]:
    """What the stage will hold at its peak, in bytes, or None when nothing says (see the module)."""
    config = build.config
    read = weights_bytes(build, stage) if build.pipeline.row(stage).memory_from_upstream else 0
    if inputs.get("checkpoint") and config.checkpoint:
        read += sum(f.stat().st_size for f in config.checkpoint.rglob("*") if f.is_file())
    factor = build.pipeline.row(stage).memory_factor or workers.INPUT_FACTOR
    from_inputs = int(read * factor) + workers.PROCESS_BYTES if read else None
    last = last_peak(build, stage)
    from_history = int(last * workers.HISTORY_MARGIN) if last else None
    known = [b for b in (from_inputs, from_history) if b is not None]
    return max(known) if known else None


def resources(build, stage: Stage, inputs: dict) -> dict[str, float]:
    """What the stage asks of a cluster's worker: one of its row's device, and its memory estimate."""
    return cluster.resources_for(device_of(build, stage), memory_estimate(build, stage, inputs))


def weights_bytes(build, stage: Stage) -> int:
    """The bytes of the largest of the stages it depends on, as they read (a blob the store keeps
    as ranges of others counts its whole size): the weights it is handed, once. Each upstream stage
    of a model's method hands on all its weights (the bundle, the exported program, the compiled
    blob), so their sum would count them several times over."""
    largest = 0
    for upstream in build.pipeline.dependencies(stage, build.config):
        stamp = build.read_stamp(upstream)
        if stamp is not None:
            largest = max(largest, build.store.objects.logical_bytes(set(stamp.outputs.values())))
    return largest


def last_peak(build, stage: Stage) -> Optional[int]:
    """The memory the stage's last run held at its peak: its stamp's, else that of the same stage
    of another method (the methods of one model hold the same weights: in a first build, the method
    exported first sizes the next), else the newest logged build of this model and target that ran
    it. The private part of its resident peak where the stamp has it: mapped weights count in every
    process's resident size, but the page cache holds them once and gives them back under pressure."""
    for candidate in _and_siblings(build, stage):
        stamp = build.read_stamp(candidate)
        if stamp is not None and stamp.status == "ran" and (stamp.peak_private or stamp.peak_rss):
            return int(stamp.peak_private or stamp.peak_rss)
    return next((int(row["peak_rss"]) for row in history.logged_rows(build, stage) if row.get("peak_rss")), None)


def last_device_peak(build, stage: Stage) -> Optional[int]:
    """The device bytes the stage allocated at most in its last run (its value's peak_gpu_bytes),
    else those of the same stage of another method."""
    for candidate in _and_siblings(build, stage):
        stamp = build.read_stamp(candidate)
        peak = stamp.value.get("peak_gpu_bytes") if stamp is not None and isinstance(stamp.value, dict) else None
        if peak:
            return int(peak)
    return None


def _and_siblings(build, stage: Stage) -> list[Stage]:
    """The stage, then the same stage of the model's other methods (which hold the same weights)."""
    return [stage] + [Stage(stage.kind, m) for m in build.config.methods if stage.method and m != stage.method]

"""Which ready stage a free worker takes first: the one with the longest way still to go after it.

doit hands ready tasks to free workers first come, first served. In a build with more ready
stages than workers that can put a stage off the critical path ahead of one on it: at 40 layers of
Qwen3.5-35B-A3B on the H100 (2026-12-06), export.prefill's end made edge.prefill and both references
ready at once, two free workers took the references, and edge.prefill, the head of the longest
chain (edge -> compile -> blob -> package -> verify, 7 of the build's 13 minutes), waited 42-50 s
for a third.

The rank of a stage is its expected seconds plus the largest rank among the stages that depend on
it (the "upward rank" of list scheduling, as HEFT orders tasks): the length of the longest chain it
starts. Expected seconds come from the stage's last run (cudabuild.engine.history), else from a
table of typical seconds by kind, so a first build ranks edge and compile above a reference too.

Owns the ranks and the order of doit's ready queue (`ordered_ready`). Must not touch: whether a
stage runs or what it may hold (the runner and cudabuild.engine.admission decide).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Optional

# Typical seconds of a stage of each kind where it has no run to go by: only their proportions
# matter (a compile is long, a reference shorter than the chain after edge, a probe instant).
TYPICAL_SECONDS = {"probe": 1.0, "quantize": 20.0, "trace": 30.0, "export": 5.0, "edge": 40.0, "compile": 100.0, "blob": 10.0,
                   "package": 20.0, "reference": 40.0, "verify": 15.0, "manifest": 0.0}


def ranks(stages: Iterable, dependencies: Callable, expected: Callable[[object], Optional[float]]) -> dict:
    """{stage: its rank} for `stages` (each with a `kind`), where `dependencies(stage)` are the
    stages it waits for and `expected(stage)` its seconds, or None for the typical ones."""
    stages = list(stages)
    dependents: dict = {s: [] for s in stages}
    for stage in stages:
        for upstream in dependencies(stage):
            if upstream in dependents:
                dependents[upstream].append(stage)
    rank: dict = {}

    def of(stage) -> float:
        if stage not in rank:
            own = expected(stage)
            own = TYPICAL_SECONDS.get(stage.kind, 10.0) if own is None else own
            rank[stage] = own + max((of(d) for d in dependents[stage]), default=0.0)
        return rank[stage]

    for stage in stages:
        of(stage)
    return rank


class PriorityReady(deque):
    """doit's ready queue (a deque of its ExecNodes) whose `popleft` gives the highest-ranked
    node, first come first served among equals; every other deque operation is deque's."""

    def __init__(self, rank_of: Callable[[str], float], items=()):
        super().__init__(items)
        self.rank_of = rank_of

    def popleft(self):
        if len(self) <= 1:
            return super().popleft()
        best = max(range(len(self)), key=lambda i: (self.rank_of(self[i].task.name), -i))
        node = self[best]
        del self[best]
        return node


def ordered_ready(rank_of: Callable[[str], float]) -> None:
    """From now on, doit's dispatchers order their ready queue by `rank_of(task name)` (higher
    first; a name it does not know ranks 0). doit has no setting for this: its TaskControl makes
    each run's TaskDispatcher, whose `ready` deque this replaces as it is made."""
    from doit import control

    if getattr(control.TaskControl.task_dispatcher, "cudabuild_ordered", False):
        control.TaskControl.task_dispatcher.rank_of[0] = rank_of
        return
    original = control.TaskControl.task_dispatcher
    holder = [rank_of]

    def task_dispatcher(self):
        dispatcher = original(self)
        dispatcher.ready = PriorityReady(lambda name: holder[0](name), dispatcher.ready)
        return dispatcher

    task_dispatcher.cudabuild_ordered = True
    task_dispatcher.rank_of = holder
    control.TaskControl.task_dispatcher = task_dispatcher

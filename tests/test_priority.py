"""cudabuild.engine.priority: the ranks of a build's stages and the order a real doit run takes
ready tasks in."""

from __future__ import annotations

import types
from collections import namedtuple

import pytest
from doit.cmd_base import ModuleTaskLoader
from doit.doit_cmd import DoitMain

from cudabuild.engine import priority
from cudabuild.engine.graph import Stage

# The qwen_moe chain of one method: export -> edge -> compile -> blob -> package -> verify, and the
# reference beside edge and compile, needed only by verify.
EDGES = {"export": [], "edge": ["export"], "compile": ["edge"], "blob": ["compile", "export"], "package": ["blob"],
         "reference": ["export"], "verify": ["blob", "package", "reference"]}


def chain():
    stages = {k: Stage(k, None if k == "package" else "prefill") for k in EDGES}
    return stages, (lambda s: [stages[d] for d in EDGES[s.kind]])


def test_a_first_build_ranks_the_chain_after_edge_above_the_reference():
    stages, deps = chain()
    rank = priority.ranks(stages.values(), deps, lambda s: None)
    assert rank[stages["edge"]] > rank[stages["reference"]]
    assert rank[stages["export"]] == max(rank.values())  # everything waits on it
    typical = priority.TYPICAL_SECONDS
    assert rank[stages["verify"]] == typical["verify"]
    assert rank[stages["edge"]] == sum(typical[k] for k in ("edge", "compile", "blob", "package", "verify"))


def test_measured_seconds_rank_a_long_reference_first():
    stages, deps = chain()
    seconds = {"reference": 900.0}
    rank = priority.ranks(stages.values(), deps, lambda s: seconds.get(s.kind))
    assert rank[stages["reference"]] > rank[stages["edge"]]


def test_the_ready_queue_gives_the_highest_rank_first_and_keeps_arrival_order_among_equals():
    Node = namedtuple("Node", "task")
    Task = namedtuple("Task", "name")
    ranks = {"a": 1.0, "b": 5.0, "c": 5.0, "d": 2.0}
    ready = priority.PriorityReady(ranks.get, [Node(Task(n)) for n in "abcd"])
    assert [ready.popleft().task.name for _ in range(4)] == ["b", "c", "d", "a"]


@pytest.mark.parametrize("favoured", ["late", "early"])
def test_a_doit_run_takes_the_ready_task_of_higher_rank_first(tmp_path, favoured):
    """A real doit run, one task at a time: once `start` is done both others are ready, and the
    one ranked higher runs first, whichever doit would have taken (its order is first come)."""
    ran = []
    ranks = {"early": 1.0, "late": 1.0, favoured: 10.0}

    def task(name, deps):
        return {"name": name, "actions": [lambda: ran.append(name)], "task_dep": deps, "verbosity": 0}

    def task_build():
        yield task("start", [])
        yield task("early", ["build:start"])
        yield task("late", ["build:start"])

    module = types.ModuleType("dodo_priority")
    module.task_build = task_build
    module.DOIT_CONFIG = {"dep_file": str(tmp_path / ".doit.db"), "verbosity": 0}
    priority.ordered_ready(lambda name: ranks.get(name.partition(":")[2], 0.0))
    assert DoitMain(ModuleTaskLoader(module)).run(["build"]) == 0
    assert ran == ["start", favoured, "late" if favoured == "early" else "early"]

"""cudabuild.engine.admission: a stage's needs against the budgets of this machine and its device,
with real runners, real stamps and the real ledger; device targets through the table's rows (a
cuda build's configuration, which needs no GPU to be read)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from cudabuild.config import load_config
from cudabuild.engine import admission, workers
from cudabuild.engine.graph import Stage
from cudabuild.engine.runner import Runner
from cudabuild.engine.store import Store
from cudabuild.errors import DeviceTooSmall

GiB = 1 << 30


@pytest.fixture
def tiny(built_tiny, tmp_path):
    proj = built_tiny.copy(tmp_path)
    store = Store(proj.cache)
    yield proj, store, load_config(proj.root, {"model": "tiny_lm", "target": "cpu"}, store)
    store.close()


def test_a_stage_that_cannot_fit_the_device_is_refused_before_it_starts_naming_its_need_and_the_room(tmp_path):
    store = Store(tmp_path / "cache")
    settings = {"model": "qwen_moe", "target": "cuda", "size": "35b-a3b", "low_memory_mode": "ON"}
    runner = Runner(load_config(workers_project(), settings, store), store, "r")
    verify = Stage("verify", "decode")
    need, basis = admission.device_need(runner, verify)  # nothing measured or handed yet: the projection
    assert need == int(runner.config.weights_bytes * 1.0) and basis.startswith("projected as 1x")
    admission.refuse_if_too_big(runner, verify, "cuda", capacity=need)  # it fits: nothing said
    with pytest.raises(DeviceTooSmall) as refused:
        admission.refuse_if_too_big(runner, verify, "cuda", capacity=need - 1)
    assert str(refused.value).startswith(f"stage verify.decode needs ~{need / GiB:.1f} GiB of cuda memory (projected")
    assert "and the device has" in str(refused.value) and "\n" not in str(refused.value)
    store.close()


def test_a_35b_build_is_refused_up_front_on_a_card_too_small_for_its_weights(tmp_path):
    """The recipe's projection of its weights sizes every device stage before the first runs:
    all 40 layers of Qwen3.5-35B-A3B (about 19 GiB of int4 weights) pass a 22 GiB card with
    low_memory_mode=ON; verify, which holds them all, is refused on a 16 GiB one; without
    low_memory_mode the compile (which then moves them to the device) is refused first."""
    store = Store(tmp_path / "cache")
    settings = {"model": "qwen_moe", "target": "cuda", "size": "35b-a3b", "low_memory_mode": "ON"}
    runner = Runner(load_config(workers_project(), settings, store), store, "r")
    admission.device_preflight(runner, capacity=21 * GiB)
    with pytest.raises(DeviceTooSmall, match=r"^stage verify\.decode needs ~19\.\d GiB of cuda memory \(projected"):
        admission.device_preflight(runner, capacity=16 * GiB)
    plain = Runner(load_config(workers_project(), dict(settings, low_memory_mode="OFF"), store), store, "r")
    with pytest.raises(DeviceTooSmall, match=r"^stage compile\.decode needs ~5\d\.\d GiB"):
        admission.device_preflight(plain, capacity=21 * GiB)
    store.close()


def workers_project():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_the_host_budget_is_the_tightest_of_the_machine_its_cgroup_and_the_setting(tmp_path):
    total = workers._meminfo("MemTotal")
    assert workers.memory_budget({}) <= int(total * workers.USABLE_FRACTION)
    assert workers.memory_budget({"CUDABUILD_HOST_MEMORY": "1GiB"}) == int(GiB * workers.USABLE_FRACTION)
    # A cgroup of its own, two levels down: the tighter limit, its parent's, binds.
    root = tmp_path / "cgroup"
    (root / "builds" / "one").mkdir(parents=True)
    (root / "builds" / "memory.max").write_text("1073741824\n")
    (root / "builds" / "one" / "memory.max").write_text("max\n")
    (root / "builds" / "one" / "memory.current").write_text("1000\n")
    membership = tmp_path / "cgroup.self"
    membership.write_text("0::/builds/one\n")
    assert workers.cgroup_memory(root, membership) == (GiB, 1000)
    membership.write_text("0::/\n")
    assert workers.cgroup_memory(root, membership) == (None, None)


def _admitted_spans(runner, stages, hold: float) -> list[tuple[float, float]]:
    """Each stage's (in, out) times, all asking for their turn at once, each holding it `hold` s."""
    spans: dict = {}

    def take(stage):
        with admission.admitted(runner, stage, runner.inputs(stage)):
            start = time.monotonic()
            time.sleep(hold)
        spans[stage] = (start, time.monotonic())

    threads = [threading.Thread(target=take, args=(s,)) for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [spans[s] for s in stages]


def test_a_host_budget_small_enough_to_bind_lets_the_stages_in_one_at_a_time(tiny, monkeypatch):
    """tiny_lm's compiles each measured a few hundred MB: under a 256 MiB host (179 MiB for stages)
    the second waits for the first, as on a host that cannot take them side by side; under 64 GiB
    both are in at once."""
    proj, store, cpu = tiny
    runner = Runner(cpu, store, "r", workers=2)
    both = [Stage("compile", "decode"), Stage("compile", "prefill")]
    monkeypatch.setenv("CUDABUILD_HOST_MEMORY", "256MiB")
    assert admission.memory_estimate(runner, both[0], runner.inputs(both[0])) > workers.memory_budget()
    (a_in, a_out), (b_in, b_out) = sorted(_admitted_spans(runner, both, 0.6))
    assert b_in >= a_out  # one at a time
    monkeypatch.setenv("CUDABUILD_HOST_MEMORY", "64GiB")
    (a_in, a_out), (b_in, b_out) = sorted(_admitted_spans(runner, both, 0.6))
    assert b_in < a_out  # side by side

"""Stages side by side (cudabuild.engine.workers): how many workers a build gets, which stages are
let in beside others and which must run alone, the lock that enforces it, and that a build whose
stages ran in two workers is the build one worker makes (the run's shared tiny build uses two)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import assert_ok

from cudabuild.engine import workers
from cudabuild.engine.graph import Stage
from cudabuild.errors import InvalidOption
from cudabuild.pipeline import PIPELINE

GiB = 1 << 30


def test_the_worker_count_comes_from_the_command_line_then_the_environment_then_the_cores():
    from cudabuild.doit_argv import CommandLine

    assert CommandLine.read(["-n", "3", "export"]).workers(2) == 3
    assert CommandLine.read(["-n4", "export"]).workers(2) == 4
    assert CommandLine.read(["--process=5", "export"]).workers(2) == 5
    assert CommandLine.read(["export", "model=tiny_lm"]).workers(2) == 2
    assert CommandLine.read(["-n", "0", "export"]).workers(2) == 1
    assert workers.default_workers({"CUDABUILD_JOBS": "3"}) == 3
    assert workers.default_workers({}) == max(1, min(workers.usable_cores(), workers.MAX_DEFAULT_WORKERS))
    for bad in ("0", "two", "-1"):
        with pytest.raises(InvalidOption, match=f"CUDABUILD_JOBS={bad}: expected a whole number"):
            workers.default_workers({"CUDABUILD_JOBS": bad})


def test_a_bad_jobs_setting_stops_the_build_in_one_line_before_anything_runs(project):
    result = project.export("model=tiny_lm", "target=cpu", env=project.env(CUDABUILD_JOBS="many"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "cudabuild: error: CUDABUILD_JOBS=many: expected a whole number of stages to run at once, 1 or more"]
    assert not (project.root / "build").exists()


def test_a_stage_reserves_its_estimate_and_runs_alone_only_when_nothing_sizes_it_or_it_is_past_the_budget():
    fits = workers.admission(2, 1 * GiB, None, 14 * GiB)
    assert not fits.alone and fits.need == 1 * GiB and "of the 14.0 GiB" in fits.why
    # Two 6.6 GiB stages fit a 14 GiB budget together; the ledger, not a rule of thumb, says when.
    assert workers.admission(4, int(6.6 * GiB), None, 14 * GiB).need == int(6.6 * GiB)
    big = workers.admission(2, 20 * GiB, None, 14 * GiB)
    assert big.alone and big.need is None and "more than the 14.0 GiB" in big.why
    unknown = workers.admission(2, None, None, 14 * GiB)
    assert unknown.alone and "not known" in unknown.why
    assert workers.admission(2, 1 * GiB, "it uses the GPU", 14 * GiB).alone
    assert workers.admission(2, 1 * GiB, None, None).alone
    assert not workers.admission(1, None, "it uses the GPU", None).alone  # one worker: nothing beside it
    assert workers.memory_budget() > 0  # this machine's /proc/meminfo


def test_cpu_compiles_that_tune_run_alone_and_device_stages_take_the_device_lock():
    compile_row, verify_row = PIPELINE.rows["compile"], PIPELINE.rows["verify"]

    def config(target, **specs):
        return SimpleNamespace(target=target, specs={"decode": specs})

    assert compile_row.runs_alone(config("cpu", max_autotune="OFF"), "decode") is None
    assert "timing" in compile_row.runs_alone(config("cpu", max_autotune="ON"), "decode")
    # On cuda, the device's lock admits compiles and verifies by device memory (below), while
    # export and edge (host work) go on beside; tuning's timings take the timing lock instead.
    assert compile_row.runs_alone(config("cuda", max_autotune="ON"), "decode") is None
    assert compile_row.device(config("cuda"), "decode") == verify_row.device(config("cuda"), "decode") == "cuda"
    assert compile_row.device(config("cpu"), "decode") is None and verify_row.device(config("cpu"), "decode") is None
    assert PIPELINE.rows["edge"].device is None and PIPELINE.rows["export"].device is None
    assert PIPELINE.rows["edge"].runs_alone is None and PIPELINE.rows["export"].memory_from_upstream


HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cudabuild.engine import ledger
    need = None if sys.argv[2] == "all" else int(sys.argv[2])
    with ledger.reserved(Path(sys.argv[1]), need, 10, "holder") as waited:
        print("in", flush=True)
        sys.stdin.readline()
""")


def _holder(path, need: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(path), need], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_the_ledger_lets_stages_in_while_their_needs_fit_together_and_frees_a_dead_ones(tmp_path):
    from cudabuild.engine import ledger

    path = tmp_path / "locks" / "ledger-memory.json"
    first = _holder(path, "6")
    try:
        assert first.stdout.readline().strip() == "in"
        assert ledger.held(path) == 6
        # 6 + 4 fit a budget of 10: the second is in beside the first at once ...
        second = _holder(path, "4")
        assert second.stdout.readline().strip() == "in"
        assert ledger.held(path) == 10
        # ... and a third, of 1, is not: it waits until one of them is out.
        third = _holder(path, "1")
        time.sleep(1.0)
        assert ledger.held(path) == 10
        second.communicate("\n", timeout=60)
        assert third.stdout.readline().strip() == "in"
        assert ledger.held(path) == 7
        # A holder that dies without letting go holds nothing once it is gone.
        third.kill()
        third.wait()
        assert ledger.held(path) == 6
        # One that asks for all of it (alone) waits for every other to leave.
        alone = _holder(path, "all")
        time.sleep(1.0)
        assert ledger.held(path) == 6
    finally:
        first.communicate("\n", timeout=60)
    assert alone.stdout.readline().strip() == "in"
    assert ledger.held(path) == 10
    alone.communicate("\n", timeout=60)
    assert ledger.held(path) == 0


def test_the_memory_estimate_scales_with_upstream_bytes_and_remembers_the_last_peak(tiny_copy):
    from cudabuild.config import load_config
    from cudabuild.engine import admission
    from cudabuild.engine.runner import Runner
    from cudabuild.engine.store import Store

    store = Store(tiny_copy.cache)
    config = load_config(tiny_copy.root, {"model": "tiny_lm", "target": "cpu"}, store)
    runner = Runner(config, store, "test", workers=2)
    edge = Stage("edge", "decode")
    # The weights it is handed: the largest upstream stage's outputs (export's, not the probe's).
    export_bytes = store.objects.logical_bytes(runner.read_stamp(Stage("export", "decode")).outputs.values())
    assert admission.weights_bytes(runner, edge) == export_bytes
    last_peak = runner.read_stamp(edge).peak_rss
    assert export_bytes > 0 and last_peak > 0
    assert admission.memory_estimate(runner, edge, runner.inputs(edge)) == max(
        int(export_bytes * PIPELINE.rows["edge"].memory_factor) + workers.PROCESS_BYTES, int(last_peak * workers.HISTORY_MARGIN))
    # With neither a last run nor upstream bytes (the build log gone, no stamps), nothing sizes it.
    for stamp in (tiny_copy.build_dir / ".stamps").glob("*.json"):
        stamp.unlink()
    store.table.cache.clear()
    assert admission.memory_estimate(runner, edge, runner.inputs(edge)) is None


def test_a_build_run_by_two_workers_is_the_build_one_worker_makes(tiny_copy, tmp_path):
    events = json.loads((tiny_copy.build_dir / "trace.json").read_text())["traceEvents"]
    runs = {e["name"]: e for e in events if e["cat"] == "stage" and e["args"].get("step") == "execute"}
    assert len({runs[s]["pid"] for s in runs if s != "probe"}) == 2  # two worker processes ran stages
    # Each compile was let in beside the build's other stages, not alone. (Whether the two did run at
    # the same moment depends on how fast each method's chain got there, i.e. on the machine's load.)
    decode = runs["compile.decode"]
    admitted = [e for e in events if e["name"] == "admitted"]
    assert admitted and all(not e["args"]["alone"] for e in admitted
                            if runs["compile.decode"]["ts"] <= e["ts"] <= decode["ts"] + decode["dur"])
    outputs = {name: (tiny_copy.build_dir / name).read_bytes() for name in ("model.pte", "aoti_cpu_blob.ptd")}

    # One worker computes the same key for every stage: all cached ...
    again = tiny_copy.export("model=tiny_lm", "target=cpu")
    assert_ok(again)
    assert set(tiny_copy.statuses().values()) == {"cached"}
    # ... and, with build/ gone, restores every one of them from what the two workers stored.
    shutil.rmtree(tiny_copy.root / "build")
    for db in tiny_copy.root.glob(".doit.db*"):
        db.unlink()
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    assert set(tiny_copy.statuses().values()) == {"restored"}
    assert {name: (tiny_copy.build_dir / name).read_bytes() for name in outputs} == outputs


def test_a_build_for_a_device_defaults_to_three_workers_and_a_cpu_build_to_one_per_core(project):
    from cudabuild.doit_tasks import _builds_for_a_device

    assert _builds_for_a_device({"target": "cuda"}) and not _builds_for_a_device({"target": "cpu"})
    assert not _builds_for_a_device({"target": "tpu"})  # left to the build's own one-line error
    # What doit is handed: DOIT_CONFIG's worker processes once doit has loaded dodo.py with the
    # command line's target (0 is doit's in-process runner).
    for target, expected in (("cuda", min(3, workers.default_workers({}))), ("cpu", workers.default_workers({}))):
        result = project.run("-c", LOADED_CONFIG, "list", "model=tiny_lm", f"target={target}", CUDABUILD_JOBS="")
        processes = int(result.stdout.strip().splitlines()[-1])
        assert processes == (expected if expected > 1 else 0), (target, result.stdout)


LOADED_CONFIG = textwrap.dedent("""
    import sys
    from doit.doit_cmd import DoitMain
    DoitMain().run(sys.argv[1:])
    print(sys.modules["dodo"].DOIT_CONFIG["num_process"])
""")


def test_device_stages_reserve_their_measured_peak_or_a_first_builds_estimate_of_the_device_budget():
    # A stage with neither a measured peak nor inputs to size it by: one device stage at a time.
    first = workers.device_admission(2, None, 68 * GiB)
    assert first.alone and "not known" in first.why
    # A first build's stage: its inputs' weights times its row's factor, and 2 GiB. 20.4 GB of a
    # 35B MoE's int4 weights at 1.3x: about 26.7 GiB, of which two fit 0.85 of an 80 GB card.
    weights = 20_382_819_592
    compile_ = workers.device_admission(3, None, int(0.85 * 80 * GiB), from_inputs=weights, input_factor=1.3)
    assert not compile_.alone and compile_.need == int(weights * 1.3) + workers.DEVICE_FIRST_RUN_BYTES
    assert "estimated from its inputs" in compile_.why
    # A measured peak wins over the estimate, both ways; past the budget, alone.
    assert workers.device_admission(2, 3 * GiB, 24 * GiB, from_inputs=6 * GiB, input_factor=3.0).need == \
        int(3 * GiB * workers.HISTORY_MARGIN) + workers.DEVICE_PROCESS_BYTES
    assert workers.device_admission(2, 30 * GiB, 20 * GiB, from_inputs=4 << 20, input_factor=1.3).alone
    assert workers.device_admission(2, 3 * GiB, None).alone  # no nvidia-smi: nothing is assumed
    assert not workers.device_admission(1, None, None).alone  # one worker: nothing beside it
    assert workers.device_budget("cpu") is None
    if shutil.which("nvidia-smi") is None:
        assert workers.device_budget("cuda") is None
    # The pipeline's factors: low_memory_mode decides a compile's.
    compile_row = PIPELINE.rows["compile"]
    on = SimpleNamespace(target="cuda", specs={"decode": {"low_memory_mode": "ON"}})
    off = SimpleNamespace(target="cuda", specs={"decode": {"low_memory_mode": "OFF"}})
    assert compile_row.device_factor(on, "decode") < compile_row.device_factor(off, "decode")
    ledger = workers.device_ledger(Path("/c/locks"), "cuda")
    assert ledger.name == "ledger-device-cuda.json" and workers.timing_lock(ledger.parent, "cuda").name == "device-cuda.timing"


def test_a_device_memory_cap_makes_a_big_card_decide_as_a_small_one_would(tmp_path, monkeypatch):
    """$CUDABUILD_DEVICE_MEMORY: the device's budget is of the cap, not of the card, so two
    compiles of ~12 GiB that share an 80 GB card run one at a time as on a 24 GB one (a stand-in
    nvidia-smi reports an 80 GiB card)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '81920'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    assert workers.device_budget("cuda", {}) == int(80 * 2**30 * workers.DEVICE_USABLE_FRACTION)
    capped = workers.device_budget("cuda", {"CUDABUILD_DEVICE_MEMORY": "24GiB"})
    assert capped == int(24 * 2**30 * workers.DEVICE_USABLE_FRACTION)
    peak = 12 * 2**30
    need = workers.device_admission(2, peak, capped).need
    assert need is not None and 2 * need > capped  # one at a time under the cap
    assert 2 * workers.device_admission(2, peak, workers.device_budget("cuda", {})).need <= workers.device_budget("cuda", {})
    with pytest.raises(InvalidOption, match="CUDABUILD_DEVICE_MEMORY '24 gigs' is not a size"):
        workers.device_memory_cap({"CUDABUILD_DEVICE_MEMORY": "24 gigs"})

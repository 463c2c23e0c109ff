"""Stages side by side (cudabuild.engine.workers): how many workers a build gets, which stages are
let in beside others and which must run alone, the lock that enforces it, and that a build whose
stages ran in two workers is the build one worker makes (the run's shared tiny build uses two)."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import textwrap
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
    from cudabuild.doit_tasks import workers_from_argv

    assert workers_from_argv(["-n", "3", "export"], 2) == 3
    assert workers_from_argv(["-n4", "export"], 2) == 4
    assert workers_from_argv(["--process=5", "export"], 2) == 5
    assert workers_from_argv(["export", "model=tiny_lm"], 2) == 2
    assert workers_from_argv(["-n", "0", "export"], 2) == 1
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


def test_stages_run_beside_others_only_when_that_many_of_them_fit_in_memory():
    fits = workers.admission(2, 1 * GiB, None, 20 * GiB)
    assert not fits.alone and "fits 2 times" in fits.why
    # A 3.7 GB checkpoint's stage (1.5 x 3.7 + 1 GiB), twice, is more than half of 20 GiB: alone.
    assert workers.admission(2, int(6.6 * GiB), None, 20 * GiB).alone
    assert workers.admission(4, 3 * GiB, None, 20 * GiB).alone
    assert not workers.admission(2, 4 * GiB, None, 20 * GiB).alone
    unknown = workers.admission(2, None, None, 20 * GiB)
    assert unknown.alone and "not known" in unknown.why
    assert workers.admission(2, 1 * GiB, "it uses the GPU", 20 * GiB).alone
    assert workers.admission(2, 1 * GiB, None, None).alone
    assert not workers.admission(1, None, "it uses the GPU", None).alone  # one worker: nothing beside it


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
    assert PIPELINE.rows["edge"].runs_alone is None and not PIPELINE.rows["export"].memory_from_upstream


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cudabuild.engine import workers
    with workers.admitted(Path(sys.argv[1]), alone=sys.argv[2] == "alone"):
        print("held", flush=True)
        sys.stdin.readline()
""")


def _try(lock, mode) -> bool:
    with open(lock, "a+") as handle:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


@pytest.mark.parametrize("alone", [True, False])
def test_the_admission_lock_lets_shared_stages_in_together_and_an_alone_stage_in_by_itself(tmp_path, alone):
    lock = tmp_path / "locks" / "stages"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "alone" if alone else "beside"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _try(lock, fcntl.LOCK_SH) is (not alone)  # another stage beside it: only if it is not alone
        assert _try(lock, fcntl.LOCK_EX) is False  # a stage that must be alone waits either way
    finally:
        holder.communicate("\n", timeout=600)
    assert _try(lock, fcntl.LOCK_EX)


def test_the_memory_estimate_scales_with_upstream_bytes_and_remembers_the_last_peak(tiny_copy):
    from cudabuild.config import load_config
    from cudabuild.engine import admission
    from cudabuild.engine.runner import Runner
    from cudabuild.engine.store import Store

    store = Store(tiny_copy.cache)
    config = load_config(tiny_copy.root, {"model": "tiny_lm", "target": "cpu"}, store)
    runner = Runner(config, store, "test", workers=2)
    edge = Stage("edge", "decode")
    upstream = [sha for s in (Stage("probe"), Stage("export", "decode")) for sha in runner.read_stamp(s).outputs.values()]
    export_bytes = store.blob_bytes(upstream)
    last_peak = runner.read_stamp(edge).peak_rss
    assert export_bytes > 0 and last_peak > 0
    assert admission.memory_estimate(runner, edge, runner.inputs(edge)) == max(
        int(export_bytes * workers.INPUT_FACTOR) + workers.PROCESS_BYTES, int(last_peak * workers.HISTORY_MARGIN))
    # Export's memory is its model's, not its upstream's: without a last run nothing sizes it ...
    export = Stage("export", "prefill")
    for method in config.methods:
        (tiny_copy.build_dir / ".stamps" / f"export.{method}.json").unlink()
    store.cache.clear()  # ... the build log included
    assert admission.memory_estimate(runner, export, runner.inputs(export)) is None


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
    import cudabuild.doit_tasks as tasks
    print(tasks.DOIT_CONFIG["num_process"])
""")


def test_stages_share_the_device_once_their_measured_peaks_fit_in_its_free_memory():
    # A stage with neither a measured peak nor inputs to size it by: one device stage at a time.
    first = workers.device_admission(2, None, 80 * GiB)
    assert first.alone and "not known" in first.why
    # A first build's stage is sized from its inputs: 3x their bytes and 2 GiB. tiny_lm's few MiB
    # share an H200; 6 GiB of weights (two stages of 20 GiB) do not fit in 24 GiB free.
    assert not workers.device_admission(2, None, 130 * GiB, from_inputs=4 << 20).alone
    big = workers.device_admission(2, None, 24 * GiB, from_inputs=6 * GiB)
    assert big.alone and "20.0 GiB" in big.why
    # A measured peak wins over the estimate, both ways.
    assert not workers.device_admission(2, 3 * GiB, 24 * GiB, from_inputs=6 * GiB).alone
    assert workers.device_admission(2, 30 * GiB, 80 * GiB, from_inputs=4 << 20).alone
    # Measured at 3 GiB: with the margin and a CUDA context, two fit in 80 GiB, not in 8.
    assert not workers.device_admission(2, 3 * GiB, 80 * GiB).alone
    tight = workers.device_admission(2, 3 * GiB, 8 * GiB)
    assert tight.alone and "would not fit" in tight.why
    assert workers.device_admission(2, 3 * GiB, None).alone  # no nvidia-smi: nothing is assumed
    assert not workers.device_admission(1, None, None).alone  # one worker: nothing beside it
    assert workers.free_device_memory("cpu") is None
    if shutil.which("nvidia-smi") is None:
        assert workers.free_device_memory("cuda") is None
    # The runner's device lock and a compile's timing lock are two files of one cache's locks.
    locks = workers.device_lock(Path("/c/locks"), "cuda")
    assert locks.name == "device-cuda" and workers.timing_lock(locks.parent, "cuda").name == "device-cuda.timing"


def test_a_device_memory_cap_makes_a_big_card_decide_as_a_small_one_would(tmp_path, monkeypatch):
    """$CUDABUILD_DEVICE_MEMORY: free device memory counts as the cap less what is in use, so two
    compiles of ~12 GiB that share an 80 GB card run one at a time as on a 24 GB one (a stand-in
    nvidia-smi reports 70 GiB free and 10 GiB used)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '71680, 10240'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    environ = {}
    assert workers.free_device_memory("cuda", environ) == 70 * 2**30
    capped = {"CUDABUILD_DEVICE_MEMORY": "24GiB"}
    assert workers.free_device_memory("cuda", capped) == 14 * 2**30
    peak = 12 * 2**30
    assert not workers.device_admission(2, peak, workers.free_device_memory("cuda", environ)).alone
    assert workers.device_admission(2, peak, workers.free_device_memory("cuda", capped)).alone
    with pytest.raises(InvalidOption, match="CUDABUILD_DEVICE_MEMORY '24 gigs' is not a size"):
        workers.device_memory_cap({"CUDABUILD_DEVICE_MEMORY": "24 gigs"})

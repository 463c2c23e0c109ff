"""Every build writes build/<model>/<target>/trace.json, a Chrome trace (cudabuild.engine.console.trace): a span
per stage with its status and key, the phases that cost time inside them, a span for each wait,
within the build's span from the process's start to the manifest. (How much of a compile's time,
or of the build's, the spans name is bench/named_share.py's figure, not a test's.)"""

from __future__ import annotations

import json
import os
import time

from cudabuild.engine.console.trace import Recorder, now_us, phase


def spans(project) -> list[dict]:
    data = json.loads((project.build_dir / "trace.json").read_text())
    assert data["displayTimeUnit"] == "ms"
    return data["traceEvents"]


def within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1


def test_a_builds_trace_has_every_stage_within_its_wall_time(built_tiny):
    events = spans(built_tiny)
    manifest = built_tiny.manifest()
    build, = (e for e in events if e["name"] == "build")
    runs = {e["name"]: e for e in events if e["cat"] == "stage" and e["args"].get("step") == "execute"}
    for row in manifest["stages"]:
        sid = row["stage"] + (f".{row['method']}" if row["method"] else "")
        assert runs[sid]["args"]["status"] == row["status"] == "ran" and runs[sid]["args"]["key"] == row["key"]
        assert build["ts"] <= runs[sid]["ts"] and runs[sid]["ts"] + runs[sid]["dur"] <= build["ts"] + build["dur"]
    # The build's span starts with the process (its startup span) and ends after the manifest; the
    # stages lie between. (How much of it the spans cover, the rest being doit's own scheduling, is
    # bench/named_share.py's figure: a share asserted here would move with the machine's load.)
    startup, = (e for e in events if e["name"] == "startup")
    manifest_span, = (e for e in events if e["name"] == "manifest")
    assert startup["ts"] == build["ts"] and within(manifest_span, build) and within(startup, build)
    assert all(startup["ts"] + startup["dur"] <= run["ts"] + 1 and run["ts"] + run["dur"] <= manifest_span["ts"] + 1
               for run in runs.values())
    compile_run = runs["compile.decode"]
    inside = {e["name"] for e in events if e["cat"] in ("phase", "inductor")
              and compile_run["ts"] <= e["ts"] <= compile_run["ts"] + compile_run["dur"]}
    assert {"run", "load", "C++ compile", "store writes"} <= inside
    assert not (built_tiny.build_dir / ".trace").exists() or not list((built_tiny.build_dir / ".trace").glob("*.jsonl"))


def test_a_compiles_spans_are_inductors_phases_nested_in_the_stages_own_and_its_waits_are_named(built_tiny):
    """Inductor's own timers (lowering, scheduling, codegen, the C++ compile, ...) become spans of the
    compile stage, inside its `run`, inside its `admitted`; and each thing the stage waited for is a
    span of category `wait` before the run: the key's lock, its memory admission (two workers), and
    a warm process to take the call where one took it. (How much of the stage's time the spans
    name is bench/named_share.py's figure: it depends on what the machine did meanwhile.)"""
    from cudabuild.engine.admission import WAITS

    events = spans(built_tiny)
    for method in ("decode", "prefill"):
        stage, = (e for e in events if e["name"] == f"compile.{method}" and e["args"].get("step") == "execute")
        mine = [e for e in events if e["pid"] == stage["pid"] and e is not stage and within(e, stage)]
        named = {e["name"]: e for e in mine}
        inside = {e["name"] for e in mine if e.get("cat") == "inductor"}
        assert {"lowering", "scheduling", "kernel codegen", "C++ compile"} <= inside, inside
        admitted, run = named["admitted"], named["run"]
        assert within(run, admitted) and within(named["load"], run) and within(named["C++ compile"], run)
        assert not within(named["store writes"], run)
        waits = {e["name"]: e for e in mine if e.get("cat") == "wait"}
        expected = {WAITS["key"], WAITS["memory"]} | ({WAITS["warm"]} if stage["args"].get("warm") else set())
        assert set(waits) == expected, (method, sorted(waits), stage["args"])
        assert within(waits[WAITS["memory"]], admitted) and waits[WAITS["memory"]]["ts"] <= run["ts"]
        assert waits[WAITS["key"]]["ts"] + waits[WAITS["key"]]["dur"] <= admitted["ts"] + 1
        if WAITS["warm"] in waits:  # the call's wait, then the configuration read again in the warm process
            assert waits[WAITS["warm"]]["args"]["served"] is True and "configure" in named
            assert waits[WAITS["warm"]]["ts"] + waits[WAITS["warm"]]["dur"] <= named["configure"]["ts"] + 1
        aoti, = (e for e in mine if e["name"] == "AOTInductor")
        assert aoti["args"]["triton_kernels"] == aoti["args"]["triton_kernels_compiled"] == 0  # C++ kernels on the CPU
        assert 1 <= aoti["args"]["compile_threads"] <= os.cpu_count()
        assert aoti["args"]["compile_workers"] in ("pool", "in-process")


def test_the_c_compile_names_the_programs_it_runs(built_tiny):
    """What the C++ compile spends in external programs (the compiler here; nvcc, ld and objcopy
    too on cuda) is a `tool <program>` span inside its `C++ compile` span."""
    events = spans(built_tiny)
    for method in ("decode", "prefill"):
        stage, = (e for e in events if e["name"] == f"compile.{method}" and e["args"].get("step") == "execute")
        mine = [e for e in events if e["pid"] == stage["pid"] and stage["ts"] <= e["ts"] <= stage["ts"] + stage["dur"]]
        compilers = [e for e in mine if e["cat"] == "tool"
                     and e["name"] in {"tool g++", "tool c++", "tool gcc", "tool g++-real", "tool clang++"}]
        cpp, = (e for e in mine if e["name"] == "C++ compile")
        within = [t for t in compilers if cpp["ts"] <= t["ts"] and t["ts"] + t["dur"] <= cpp["ts"] + cpp["dur"] + 1]
        # Each names the command it ran, and among them are builds of C++ sources. (How much of the C++ compile they cover is a benchmark's figure,
        # bench/cuda_target.py's compile_spans: under a loaded machine, lock waits take the rest.)
        assert within, (method, compilers, cpp)
        assert all(t["args"]["command"].split()[0].endswith(t["name"].removeprefix("tool ")) for t in within), within
        assert any(".cpp" in t["args"]["command"] for t in within), within


def test_a_tool_is_named_by_its_program_and_keeps_its_command_line():
    from cudabuild.backend.inductor_phases import tool_command, tool_name

    assert tool_name(["/usr/local/cuda/bin/nvcc", "-fatbin", "k.ptx"]) == "nvcc"
    assert tool_name("objcopy --rename-section .data=.nv_fatbin k.o") == "objcopy"
    assert tool_name([b"/usr/bin/ld", b"-r"]) == "ld"
    assert tool_command(["python3", "-c", "import torch; print(1)"]) == "python3 -c 'import torch; print(1)'"
    long = tool_command(["g++"] + [f"-I/include/{i}" for i in range(100)], limit=40)
    assert len(long) == 40 and long.startswith("g++ -I/include/0") and long.endswith("...")


def test_merge_takes_this_runs_spans_from_every_process_and_leaves_other_runs(tmp_path):
    build_dir = tmp_path / "build" / "m" / "cpu"
    ours, other = Recorder(build_dir, "run-a"), Recorder(build_dir, "run-b")
    start = now_us()
    with ours.span("export.decode", "stage", step="execute") as args:
        with phase("load"):
            pass
        args["status"] = "ran"
    other.complete("compile.decode", start, now_us(), "stage")
    # A worker process of the same run (doit -n): its own part file.
    worker = {"name": "compile.prefill", "cat": "stage", "ph": "X", "ts": start, "dur": 5.0, "pid": os.getpid() + 1,
              "tid": 1, "args": {"run": "run-a", "step": "execute"}}
    (build_dir / ".trace" / f"{os.getpid() + 1}.jsonl").write_text(json.dumps(worker) + "\nnot json\n")

    path = ours.merge(start - 10, now_us())
    names = [e["name"] for e in json.loads(path.read_text())["traceEvents"]]
    assert sorted(names) == ["build", "compile.prefill", "export.decode", "load"]
    assert not (build_dir / ".trace" / f"{os.getpid() + 1}.jsonl").exists()  # merged: gone
    assert "run-b" in (build_dir / ".trace" / f"{os.getpid()}.jsonl").read_text()  # another run's: kept

    # ... until it is a day old: a build killed before its manifest never merges its part.
    stale = build_dir / ".trace" / f"{os.getpid()}.jsonl"
    os.utime(stale, (time.time() - 2 * 24 * 3600,) * 2)
    ours.merge(start - 10, now_us())
    assert not stale.exists()


WORKER_PROBE = """
import functools, json, os
from torch._inductor import async_compile
from cudabuild.backend import inductor_phases
from cudabuild.backend.cuda_env import scoped_environ

before = inductor_phases.compile_parallelism()["compile_workers"]
with scoped_environ({"CUDABUILD_WORKER_PROBE": "from the compile's environment"}):
    started = inductor_phases.start_compile_workers()
async_compile.AsyncCompile.wait_pool_ready(timeout=600)
seen = async_compile.AsyncCompile.process_pool().submit(functools.partial(os.getenv, "CUDABUILD_WORKER_PROBE")).result(timeout=600)
print(json.dumps({"before": before, "started": started, "after": inductor_phases.compile_parallelism()["compile_workers"],
                  "worker_sees": seen, "here": os.environ.get("CUDABUILD_WORKER_PROBE")}))
"""


def test_the_compile_workers_start_up_front_with_the_compiles_environment():
    """The cuda compile starts inductor's worker pool when the stage starts (aot_compile alone
    would compile its first kernels one by one): after start_compile_workers the pool answers, and
    its workers carry the variables of the environment they were started in, which this process
    has put back since."""
    import subprocess
    import sys

    from torch._inductor import async_compile

    if async_compile.get_compile_threads() <= 1:
        import pytest

        pytest.skip("inductor compiles in-process with one compile thread")
    done = subprocess.run([sys.executable, "-c", WORKER_PROBE], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"before": "in-process", "started": True, "after": "pool",
                    "worker_sees": "from the compile's environment", "here": None}, seen

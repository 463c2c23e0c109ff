"""Every build writes build/<model>/<target>/trace.json, a Chrome trace (cudabuild.engine.console.trace): a span
per stage with its status and key, the phases that cost time inside them, and spans that account
for the build's whole wall time."""

from __future__ import annotations

import json
import os
import time

from cudabuild.engine.console.trace import Recorder, now_us, phase


def spans(project) -> list[dict]:
    data = json.loads((project.build_dir / "trace.json").read_text())
    assert data["displayTimeUnit"] == "ms"
    return data["traceEvents"]


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def test_a_builds_trace_has_every_stage_and_accounts_for_its_wall_time(built_tiny):
    events = spans(built_tiny)
    manifest = built_tiny.manifest()
    build, = (e for e in events if e["name"] == "build")
    runs = {e["name"]: e for e in events if e["cat"] == "stage" and e["args"].get("step") == "execute"}
    for row in manifest["stages"]:
        sid = row["stage"] + (f".{row['method']}" if row["method"] else "")
        assert runs[sid]["args"]["status"] == row["status"] == "ran" and runs[sid]["args"]["key"] == row["key"]
        assert build["ts"] <= runs[sid]["ts"] and runs[sid]["ts"] + runs[sid]["dur"] <= build["ts"] + build["dur"]
    top = [e for e in events if e["cat"] in ("stage", "build") and e["name"] != "build"]
    assert {"startup", "manifest"} <= {e["name"] for e in top}
    # Stages of the two methods run side by side (two workers): the spans' union is the wall time.
    accounted = covered([(e["ts"], e["ts"] + e["dur"]) for e in top])
    assert abs(accounted - build["dur"]) <= 0.10 * build["dur"], (accounted, build["dur"])
    compile_run = runs["compile.decode"]
    inside = {e["name"] for e in events if e["cat"] in ("phase", "inductor")
              and compile_run["ts"] <= e["ts"] <= compile_run["ts"] + compile_run["dur"]}
    assert {"run", "load", "C++ compile", "store writes"} <= inside
    assert not (built_tiny.build_dir / ".trace").exists() or not list((built_tiny.build_dir / ".trace").glob("*.jsonl"))


def test_a_compiles_time_is_named_by_inductors_phases(built_tiny):
    """Inductor's own timers (lowering, scheduling, codegen, the C++ compile, ...) become spans of
    the compile stage: together with the stage's own (load, store writes) they name at least 90%
    of its time, so trace.json says where a compile's time went."""
    from cudabuild.backend.inductor_phases import named_share

    events = spans(built_tiny)
    for method in ("decode", "prefill"):
        stage, = (e for e in events if e["name"] == f"compile.{method}" and e["args"].get("step") == "execute")
        inside = {e["name"] for e in events if e.get("cat") == "inductor" and e["pid"] == stage["pid"]
                  and stage["ts"] <= e["ts"] <= stage["ts"] + stage["dur"]}
        assert {"lowering", "scheduling", "kernel codegen", "C++ compile"} <= inside, inside
        assert named_share(events, stage) >= 0.9, (method, named_share(events, stage))
        aoti, = (e for e in events if e["name"] == "AOTInductor" and e["pid"] == stage["pid"]
                 and stage["ts"] <= e["ts"] <= stage["ts"] + stage["dur"])
        assert aoti["args"]["triton_kernels"] == aoti["args"]["triton_kernels_compiled"] == 0  # C++ kernels on the CPU
        assert 1 <= aoti["args"]["compile_threads"] <= os.cpu_count()
        assert aoti["args"]["compile_workers"] in ("pool", "in-process")


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

"""How much of each compile stage's time trace.json names: a benchmark's figure, not a test's.

    python bench/named_share.py [--model tiny_lm] [--target cpu] [--jobs 2] [--trace build/.../trace.json]

Builds the model cold in a throwaway copy of the project (its own cache, inductor dir and warm
process), or reads a given trace.json, and prints, per compile stage: its seconds, the share of
them inside a named span (inductor's phases, the stage's own phases, and its waits: memory
admission, the key's lock, a lease, the device's lock, a warm process to take the call), the
waits' seconds, and the largest stretches no span names. What is named depends on what the
machine did meanwhile only through the waits, which are named too, so a busy machine moves
time between names, not out of them; the unnamed stretches are what to look at when the share
drops. (tests/test_trace.py checks that the spans exist, nest and name the waits; the share was
its assertion once, and failed on a busy machine while a wait had no name.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def unnamed_stretches(events: list[dict], stage: dict, top: int = 3) -> list[tuple[float, float]]:
    """The longest stretches of the stage's span that no span of its process covers (the enclosing
    ones excepted): (seconds into the stage, seconds long)."""
    from cudabuild.backend.inductor_phases import ENCLOSING

    start, end = stage["ts"], stage["ts"] + stage["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e is not stage and e.get("pid") == stage.get("pid") and e.get("cat") != "stage"
                   and e["name"] not in ENCLOSING and e["ts"] >= start and e["ts"] + e["dur"] <= end)
    gaps, reach = [], start
    for a, b in spans + [(end, end)]:
        if a > reach:
            gaps.append(((reach - start) / 1e6, (a - reach) / 1e6))
        reach = max(reach, b)
    return sorted(gaps, key=lambda g: -g[1])[:top]


def build_coverage(events: list[dict]) -> float:
    """The share of the build's span that its top-level spans (startup, stages, manifest) cover; the
    rest is doit's own scheduling between stages."""
    build = next(e for e in events if e["name"] == "build")
    top = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("stage", "build") and e is not build)
    covered, reach = 0.0, float("-inf")
    for start, end in top:
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / build["dur"] if build["dur"] else 1.0


def report(trace: Path) -> list[dict]:
    from cudabuild.backend.inductor_phases import named_share

    events = json.loads(trace.read_text())["traceEvents"]
    rows = []
    for stage in events:
        if stage.get("cat") != "stage" or not stage["name"].startswith("compile.") or stage["args"].get("step") != "execute":
            continue
        inside = [e for e in events if e.get("pid") == stage["pid"] and stage["ts"] <= e["ts"] <= stage["ts"] + stage["dur"]]
        waits: dict[str, float] = {}
        for e in inside:
            if e.get("cat") == "wait":
                waits[e["name"]] = round(waits.get(e["name"], 0.0) + e["dur"] / 1e6, 2)
        rows.append({"stage": stage["name"], "seconds": round(stage["dur"] / 1e6, 1),
                     "named": round(named_share(events, stage), 3), "waits": waits,
                     "unnamed": [(round(at, 1), round(long, 2)) for at, long in unnamed_stretches(events, stage)]})
    return rows


def cold_build(model: str, target: str, jobs: int) -> Path:
    work = Path(tempfile.mkdtemp(prefix="cudabuild-named-"))
    project = work / "project"
    project.mkdir()
    shutil.copy(ROOT / "dodo.py", project)
    for folder in ("cudabuild", "recipes"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__", "*.autotune.json"))
    env = dict(os.environ, CUDABUILD_CACHE_DIR=str(work / "cache"), CUDABUILD_PROJECT=str(project),
               CUDABUILD_INDUCTOR_DIR=str(work / "inductor"), CUDABUILD_JOBS=str(jobs), CUDABUILD_WARM_IDLE_SECONDS="30")
    env.pop("CUDABUILD_REMOTE", None)
    done = subprocess.run([sys.executable, "-m", "doit", "export", f"model={model}", f"target={target}"], cwd=project,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: the build failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return project / "build" / model / target / "trace.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--jobs", type=int, default=2, help="stages at once (CUDABUILD_JOBS), default 2")
    parser.add_argument("--trace", type=Path, help="read this trace.json instead of building")
    args = parser.parse_args()
    trace = args.trace or cold_build(args.model, args.target, args.jobs)
    print(f"{trace}")
    print(f"build: {build_coverage(json.loads(trace.read_text())['traceEvents']):.1%} of its wall time in startup, stage "
          "and manifest spans")
    for row in report(trace):
        waits = ", ".join(f"{name.removeprefix('wait: ')} {s:.1f}s" for name, s in row["waits"].items()) or "none"
        gaps = ", ".join(f"{long:.1f}s at +{at:.1f}s" for at, long in row["unnamed"]) or "none"
        print(f"{row['stage']:<16} {row['seconds']:>6.1f}s  named {row['named']:.1%}  waits: {waits}  unnamed: {gaps}")


if __name__ == "__main__":
    main()

"""Incremental-build benchmark on one recipe, every case measured side by side in one run.

    python bench/incremental.py [--model tiny_lm] [--target cpu] [--repeat 1] [--cases a,b1,b,c,d,e,f] [--keep]

(a) the plain ExecuTorch-style script (bench/baseline_lower.py: export + lower, no cache),
(b) cudabuild cold (empty cache), with its default workers (the two methods' stages side by side,
one worker per core: cudabuild.engine.workers), (b1) cold with one stage at a time (`doit -n 1`,
its own empty cache and inductor cache: the overhead of the stages themselves), (c) no-op, (d) restore after deleting build/ and .doit.db,
(e) a comment edit in the recipe (the sources are keyed by their code: nothing reruns), (f) a one-method
spec change (decode.emulate_precision_casts=OFF: decode's compile, package and decode's verify).
Each case is a whole process, timed from outside; the project is a throwaway copy, the cache a
fresh folder, and inductor's cache a fresh folder too, so (a) and (b) both start cold. (c) to (f)
follow (b) in its project. The warm process a case leaves for its cache is stopped once no later
case uses that cache, so that its imports do not run beside the next case, and none outlives the
bench. `--cases a` (the baseline alone) is the smallest run. Prints the times and the ratios of
the baseline to each case measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import copy_project, stop_warm_processes  # noqa: E402

CASES = ("a", "b1", "b", "c", "d", "e", "f")
NAMES = {"a": "a_baseline", "b1": "b1_cold_one_worker", "b": "b_cold", "c": "c_noop", "d": "d_restore",
         "e": "e_comment_edit", "f": "f_method_spec"}


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return elapsed


def one_round(model: str, target: str, cases: list[str], keep: bool = False) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-"))
    try:
        project = copy_project(work / "project")
        env = dict(os.environ, CUDABUILD_CACHE_DIR=str(work / "cache"), CUDABUILD_PROJECT=str(project),
                   CUDABUILD_INDUCTOR_DIR=str(work / "inductor-cudabuild"))
        env.pop("CUDABUILD_REMOTE", None)
        env.pop("CUDABUILD_JOBS", None)  # (b) is the default
        doit = [sys.executable, "-m", "doit", "export", f"model={model}", f"target={target}"]
        times = {}
        if "a" in cases:
            baseline_env = dict(env, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-baseline"))
            times["a"] = timed([sys.executable, "bench/baseline_lower.py", model, target, str(work / "baseline")],
                               project, baseline_env)
        if "b1" in cases:
            one_project = copy_project(work / "project-one")
            one_env = dict(env, CUDABUILD_CACHE_DIR=str(work / "cache-one"), CUDABUILD_INDUCTOR_DIR=str(work / "inductor-one"),
                           CUDABUILD_PROJECT=str(one_project))
            times["b1"] = timed(doit[:3] + ["-n", "1"] + doit[3:], one_project, one_env)
            stop_warm_processes(work / "cache-one")  # no later case uses it
        if "b" in cases:
            times["b"] = timed(doit, project, env)
        if "c" in cases:
            times["c"] = timed(doit, project, env)
        if "d" in cases:
            shutil.rmtree(project / "build", ignore_errors=True)
            for db in project.glob(".doit.db*"):
                db.unlink()
            times["d"] = timed(doit, project, env)
        if "e" in cases:
            recipe = project / "recipes" / f"{model}.py"
            recipe.write_text(recipe.read_text() + "\n# an edit that changes no graph\n")
            times["e"] = timed(doit, project, env)
        if "f" in cases:
            times["f"] = timed(doit + ["decode.emulate_precision_casts=OFF"], project, env)
        return times
    finally:
        stop_warm_processes(work)
        if keep:  # the projects' trace.json files, to see where a case's time went (cudabuild report, Perfetto)
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES), help="a subset of a,b1,b,c,d,e,f; c to f need b")
    parser.add_argument("--keep", action="store_true", help="keep each round's projects and caches (their traces)")
    args = parser.parse_args()
    cases = [c for c in CASES if c in args.cases.split(",")]
    if set(cases) & {"c", "d", "e", "f"} and "b" not in cases:
        parser.error("cases c, d, e and f follow b's cold build: add b")
    rounds = [one_round(args.model, args.target, cases, args.keep) for _ in range(args.repeat)]
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"{args.model}/{args.target}, median of {len(rounds)} round(s), seconds per whole process:")
    for case, value in median.items():
        print(f"  {NAMES[case]:<20}{value:8.2f}")
    ratios = (("c", "(a)/(c) baseline / no-op    ", "a", "c", "x"), ("b", "(b)/(a) cold / baseline     ", "b", "a", ""),
              ("b1", "(b1)/(a) one worker / base. ", "b1", "a", ""), ("d", "(a)/(d) baseline / restore  ", "a", "d", "x"),
              ("e", "(a)/(e) baseline / edit     ", "a", "e", "x"), ("f", "(a)/(f) baseline / one spec ", "a", "f", "x"))
    for case, words, top, bottom, unit in ratios:
        if case in median and "a" in median:
            ratio = median[top] / median[bottom]
            print(f"  ratio {words}{ratio:8.1f}{unit}" if unit else f"  ratio {words}{ratio:8.2f}")


if __name__ == "__main__":
    main()

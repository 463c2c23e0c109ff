"""Incremental-build benchmark on one recipe, every case measured side by side in one run.

    python bench/incremental.py [--model tiny_lm] [--target cpu] [--repeat 1]

(a) the plain ExecuTorch-style script (bench/baseline_lower.py: export + lower, no cache),
(b) cudabuild cold (empty cache), with its default workers (the two methods' stages side by side,
one worker per core: cudabuild.engine.workers), (b1) cold with one stage at a time (`doit -n 1`,
its own empty cache and inductor cache: the overhead of the stages themselves), (c) no-op, (d) restore after deleting build/ and .doit.db,
(e) a comment edit in the recipe (the sources are keyed by their code: nothing reruns), (f) a one-method
spec change (decode.emulate_precision_casts=OFF: decode's compile, package and decode's verify).
Each case is a whole process, timed from outside; the project is a throwaway copy, the cache a
fresh folder, and inductor's cache a fresh folder too, so (a) and (b) both start cold.
Prints the times and the ratios of the baseline to each case.
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

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return elapsed


def one_round(model: str, target: str) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-"))
    try:
        project = work / "project"
        project.mkdir()
        shutil.copy(ROOT / "dodo.py", project)
        for folder in ("cudabuild", "recipes", "bench"):
            shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, CUDABUILD_CACHE_DIR=str(work / "cache"), CUDABUILD_PROJECT=str(project),
                   CUDABUILD_INDUCTOR_DIR=str(work / "inductor-cudabuild"))
        env.pop("CUDABUILD_REMOTE", None)
        env.pop("CUDABUILD_JOBS", None)  # (b) is the default
        doit = [sys.executable, "-m", "doit", "export", f"model={model}", f"target={target}"]
        times = {}
        baseline_env = dict(env, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-baseline"))
        times["a_baseline"] = timed([sys.executable, "bench/baseline_lower.py", model, target, str(work / "baseline")], project, baseline_env)
        one_project = work / "project-one"
        shutil.copytree(project, one_project)
        one_env = dict(env, CUDABUILD_CACHE_DIR=str(work / "cache-one"), CUDABUILD_INDUCTOR_DIR=str(work / "inductor-one"),
                       CUDABUILD_PROJECT=str(one_project))
        times["b1_cold_one_worker"] = timed(doit[:3] + ["-n", "1"] + doit[3:], one_project, one_env)
        times["b_cold"] = timed(doit, project, env)
        times["c_noop"] = timed(doit, project, env)
        shutil.rmtree(project / "build")
        for db in project.glob(".doit.db*"):
            db.unlink()
        times["d_restore"] = timed(doit, project, env)
        recipe = project / "recipes" / f"{model}.py"
        recipe.write_text(recipe.read_text() + "\n# an edit that changes no graph\n")
        times["e_comment_edit"] = timed(doit, project, env)
        times["f_method_spec"] = timed(doit + ["decode.emulate_precision_casts=OFF"], project, env)
        return times
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rounds = [one_round(args.model, args.target) for _ in range(args.repeat)]
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"{args.model}/{args.target}, median of {len(rounds)} round(s), seconds per whole process:")
    for name, value in median.items():
        print(f"  {name:<20}{value:8.2f}")
    print(f"  ratio (a)/(c) baseline / no-op     {median['a_baseline'] / median['c_noop']:8.1f}x")
    print(f"  ratio (b)/(a) cold / baseline      {median['b_cold'] / median['a_baseline']:8.2f}")
    print(f"  ratio (b1)/(a) one worker / base.  {median['b1_cold_one_worker'] / median['a_baseline']:8.2f}")
    print(f"  ratio (a)/(d) baseline / restore   {median['a_baseline'] / median['d_restore']:8.1f}x")
    print(f"  ratio (a)/(e) baseline / edit      {median['a_baseline'] / median['e_comment_edit']:8.1f}x")
    print(f"  ratio (a)/(f) baseline / one spec  {median['a_baseline'] / median['f_method_spec']:8.1f}x")


if __name__ == "__main__":
    main()

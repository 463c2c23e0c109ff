"""New weights, same model: what another seed costs against a cold build of the same weights, side
by side in one run, per model.

    python bench/new_weights.py [--models tiny_lm,qwen_moe] [--target cpu] [--settings "size=35b-a3b layers=4"]
                                [--no-shared] [--out DIR]

For each model, every build a whole `doit export` process in a throwaway project copy with its own
cache, timed from outside, all sharing one inductor directory (as machines with the default one do):
  A  cold, seed 0 (a fresh cache);
  N  seed 1 in A's project and cache: the weights-only path (export binds the new weights into
     the traced program, the blob rewritten, package, verify; trace, edge and compile cached),
     started without a warm process, as a nightly's next checkpoint hours later is (this cache's
     is stopped first: cudabuild.engine.warm). What it traced is printed (nothing, unless export
     refused to bind the weights);
  W  seed 2 right after N, its warm process still up, as a build minutes after the last one is;
  C  cold, seed 1, in a fresh project and cache: the same weights the slow way. N's and C's .pte and
     .ptd must be byte-identical (the bench exits non-zero where they are not);
  S  (unless --no-shared) a second machine: a fresh project and cache sharing a Redis tier (a private
     redis-server on loopback) with a first machine that built seed 0; it builds seed 2, a checkpoint
     nobody built: edge and compile come from the tier, the blob is written here.
Goals (issue 46): N / C <= 0.15 for tiny_lm and qwen_moe (tiny) on the CPU. `--target cuda` runs
the same cases on a GPU machine (bench/gpu/session.sh's `weights` and `qwenweights` cases), where
qwen_moe's quantize stage reruns for another seed by design; `--settings` adds build settings to
every build (`size=35b-a3b layers=4`). `--out DIR` also writes the figures to DIR/new_weights.json.

C starts with A's answers to inductor's CPU ISA probes (`vec_isa/`, what a cache on this machine
knows after its first compile): a cold build there does not probe the machine again, so C is a cold
build of the model, not of the machine. Every build but W starts without a warm process (a fresh
cache has none anyway): what bounds N from below is that start, torch and ExecuTorch imported
once (4-6 s on 2 cores), which package and verify need.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from remote import build, new_project, start_redis  # noqa: E402  the same throwaway projects, builds and Redis


def run(args: list[str], project: Path, env: dict, keep_warm: bool = False) -> float:
    if not keep_warm:  # this cache's warm process, if any, goes: the build starts without one
        subprocess.run([sys.executable, "-m", "cudabuild", "warm", "stop"], cwd=project, env=env, capture_output=True)
    return build(args, project, env)


def outputs(project: Path, model: str, target: str) -> dict[str, str]:
    folder = project / "build" / model / target
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(folder.glob("*.pt[ed]"))}


def ran_stages(project: Path, model: str, target: str) -> list[dict]:
    import json

    manifest = json.loads((project / "build" / model / target / "manifest.json").read_text())
    return [s for s in manifest["stages"] if s["status"] == "ran"]


def statuses(project: Path, model: str, target: str) -> str:
    """The stages that ran, and why where a weights-only build would not run them."""
    ran = []
    for s in ran_stages(project, model, target):
        name = f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]
        usual = s["stage"] in ("quantize", "export", "blob", "package", "reference", "verify")
        ran.append(name if usual else f"{name} ({s.get('reason')})")
    return ", ".join(ran)


def traced(project: Path, model: str, target: str) -> list[str]:
    """The methods torch.export traced: a trace stage that ran, or an export that could not bind
    the new weights into the traced program and traced them (its note says so)."""
    return [f"{s['stage']}.{s['method']}" for s in ran_stages(project, model, target)
            if s["stage"] == "trace" or (s["stage"] == "export" and (s.get("note") or "").startswith("traced"))]


def machine(work: Path, name: str, base_env: dict, **extra) -> tuple[Path, dict]:
    project = new_project(work / name)
    env = dict(base_env, CUDABUILD_CACHE_DIR=str(work / name / "cache"), CUDABUILD_PROJECT=str(project), **extra)
    return project, env


def known_isa(work: Path, model: str, name: str) -> None:
    """Give machine `name`'s cache the CPU ISA answers A's first compile found (see the docstring)."""
    found = work / f"{model}-a" / "cache" / "vec_isa"
    if found.is_dir():
        shutil.copytree(found, work / f"{model}-{name}" / "cache" / "vec_isa", dirs_exist_ok=True)


def one_model(model: str, target: str, work: Path, base_env: dict, shared: bool, settings: list[str]) -> dict:
    build = ["model=" + model, "target=" + target, *settings]
    times: dict[str, float] = {}
    a, a_env = machine(work, f"{model}-a", base_env)
    times["A cold seed 0"] = run(build + ["seed=0"], a, a_env)
    times["N new seed 1"] = run(build + ["seed=1"], a, a_env)
    ran, n_traced = statuses(a, model, target), traced(a, model, target)
    n_outputs = outputs(a, model, target)
    times["W new seed 2, warm kept"] = run(build + ["seed=2"], a, a_env, keep_warm=True)
    c, c_env = machine(work, f"{model}-c", base_env)
    known_isa(work, model, "c")
    times["C cold seed 1"] = run(build + ["seed=1"], c, c_env)
    same = n_outputs == outputs(c, model, target)
    result = {"times": times, "ran": ran, "traced": n_traced, "identical": same, "outputs": n_outputs}
    if shared:
        redis, url = start_redis(work)
        try:
            first, first_env = machine(work, f"{model}-s1", base_env, CUDABUILD_REMOTE=url + "/0")
            run(build + ["seed=0"], first, first_env)
            second, second_env = machine(work, f"{model}-s2", base_env, CUDABUILD_REMOTE=url + "/0")
            known_isa(work, model, "s2")
            times["S second machine, seed 2"] = run(build + ["seed=2"], second, second_env)
            result["shared_ran"] = statuses(second, model, target)
            result["shared_traced"] = traced(second, model, target)
        finally:
            redis.kill()
            redis.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_lm,qwen_moe")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--no-shared", action="store_true", help="skip the second machine through a Redis tier")
    parser.add_argument("--settings", default="", help="more NAME=VALUE settings for every build, space-separated")
    parser.add_argument("--out", type=Path, help="also write the figures to OUT/new_weights.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-weights-"))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDABUILD_", "TORCHINDUCTOR_", "TRITON_"))}
    base_env["CUDABUILD_INDUCTOR_DIR"] = str(work / "inductor")
    failed, figures = False, {}
    try:
        for model in args.models.split(","):
            r = one_model(model, args.target, work, base_env, not args.no_shared, args.settings.split())
            figures[model] = r
            t = r["times"]
            print(f"{model}/{args.target}: seconds per whole process")
            for name, seconds in t.items():
                print(f"  {name:<28}{seconds:8.1f}")
            print(f"  N ran: {r['ran']}")
            print(f"  N traced: {', '.join(r['traced']) or 'nothing'} (a new seed traces nothing: the trace stage is keyed on the code)")
            print(f"  ratio N / C  new seed / cold        {t['N new seed 1'] / t['C cold seed 1']:8.3f}   (goal <= 0.15)")
            print(f"  ratio W / C  the same, warm kept    {t['W new seed 2, warm kept'] / t['C cold seed 1']:8.3f}")
            if "S second machine, seed 2" in t:
                print(f"  ratio S / C  second machine / cold  {t['S second machine, seed 2'] / t['C cold seed 1']:8.3f}")
                print(f"  S ran: {r['shared_ran']}; traced: {', '.join(r['shared_traced']) or 'nothing'}")
            print(f"  N and C byte-identical (.pte, .ptd): {r['identical']} {r['outputs']}")
            failed |= not r["identical"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.out is not None:
            import json

            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "new_weights.json").write_text(json.dumps(
                {"target": args.target, "settings": args.settings, "models": figures}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

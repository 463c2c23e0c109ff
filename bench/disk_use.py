"""What one build leaves on disk: the cache and build/ against the weights, with blobs kept as ranges.

    python bench/disk_use.py [--model qwen_moe] [--target cpu] [--set size=35b-a3b --set layers=4] [--out DIR]

A cold `doit export` in a fresh project and cache, its folders (the cache with the stages' work
folders, build/, inductor's) sampled every 50 ms for the most they take at once (issue 52: at most
2.2x the weights at any moment), then: the weights' bytes (the quantize bundle
where the build has one, else the exported program's weight files, each counted once), the
cache's bytes (plain blobs, the manifests of blobs kept as spans, records, the folders beside it:
kernels, C++ objects, materialized spans), build/'s bytes, and their ratio to the weights. Issue
45's goal for a full qwen_moe cuda build: cache + build/ <= 2.2x the int4 bundle. Also prints
`cudabuild cache stats` and how many of the build's outputs the store keeps as spans.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def taken_bytes(*folders: Path) -> int:
    """What the files under `folders` take on the disk, read while a build adds and deletes them."""
    total = 0
    for folder in folders:
        for parent, _, names in os.walk(folder):
            for name in names:
                try:
                    stat = os.lstat(os.path.join(parent, name))
                except FileNotFoundError:
                    continue
                total += stat.st_blocks * 512 if not os.path.islink(os.path.join(parent, name)) else 0
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen_moe")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="disk-use-"))
    project, cache = work / "project", work / "cache"
    project.mkdir()
    shutil.copy(ROOT / "dodo.py", project)
    for folder in ("cudabuild", "recipes"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, CUDABUILD_CACHE_DIR=str(cache), CUDABUILD_PROJECT=str(project),
               PYTHONPATH=f"{project}:{os.environ.get('PYTHONPATH', '')}")
    inductor = work / "inductor"
    env["CUDABUILD_INDUCTOR_DIR"] = str(inductor)
    peak, stop = [0, 0.0], threading.Event()
    t0 = time.monotonic()

    def sample() -> None:  # every folder the build writes, as the disk holds it (holes take nothing)
        while not stop.wait(0.05):
            taken = taken_bytes(cache, project / "build", inductor)
            if taken > peak[0]:
                peak[:] = [taken, round(time.monotonic() - t0, 1)]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    done = subprocess.run([sys.executable, "-m", "doit", "export", f"model={args.model}", f"target={args.target}", *args.set],
                          cwd=project, env=env, capture_output=True, text=True)
    stop.set()
    sampler.join()
    seconds = time.monotonic() - t0
    if done.returncode:
        sys.exit(f"the build failed ({done.returncode}): {done.stderr[-2000:]}")
    sys.path.insert(0, str(project))
    from cudabuild.engine.store import Store

    build = project / "build" / args.model / args.target
    store = Store(cache)
    stamps = {p.stem: json.loads(p.read_text()) for p in (build / ".stamps").glob("*.json")}
    if "quantize" in stamps:
        weights = sum(stamps["quantize"]["value"]["files"].values())
        weights_from = "the quantize bundle"
    else:
        files = {sha for stage, stamp in stamps.items() if stage.startswith("export.")
                 for name, sha in stamp["outputs"].items() if name.startswith("tensor.")}
        weights = sum((store.objects.spans_of(sha) or {}).get("size") or store.objects.blob_bytes([sha]) for sha in files)
        weights_from = "the exported weight files"
    spans = sorted(f"{stage} {name}" for stage, stamp in stamps.items() for name, sha in stamp["outputs"].items()
                   if store.objects.spans_of(sha) is not None)
    usage = store.table.usage()
    store.close()
    cache_bytes, build_bytes = du(cache), du(build)
    result = {"model": args.model, "target": args.target, "settings": args.set, "seconds": round(seconds, 1),
              "weights_bytes": weights, "weights_from": weights_from, "cache_bytes": cache_bytes, "build_bytes": build_bytes,
              "cache_over_weights": round(cache_bytes / weights, 2), "build_over_weights": round(build_bytes / weights, 2),
              "total_over_weights": round((cache_bytes + build_bytes) / weights, 2),
              "peak_taken": peak[0], "peak_at_s": peak[1], "peak_over_weights": round(peak[0] / weights, 2),
              "store_usage": {k: list(v) for k, v in usage.items()}, "outputs_kept_as_spans": spans}
    stats = subprocess.run([sys.executable, "-m", "cudabuild", "cache", "stats"], cwd=project, env=env,
                           capture_output=True, text=True).stdout
    print(stats)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "disk_use.json").write_text(json.dumps(dict(result, cache_stats=stats), indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

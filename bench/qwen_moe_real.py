"""ExecuTorch's Qwen3.5-MoE at the real shapes, the whole build: per stage seconds, GPU and host peaks,
disk; then a no-op and a restore.

    python bench/qwen_moe_real.py --out DIR [--layers 8] [--low-memory ON] [--budget 1500]

`doit export model=qwen_moe target=cuda size=35b-a3b layers=N low_memory_mode=M` cold (a fresh
project, cache and kernel cache), then the same again (a no-op), then `rm -rf build` and again
(every output restored from the cache). Per stage: status, seconds, `peak_gpu_bytes` (the
allocator's peak, from the stage's value), `peak_rss` (sampled); verify's verdict (judged by the
fp32 truth where the recipe has one); the bytes of the cache and of build/ against the quantize
bundle's at rest and, sampled every second while the cold build runs, the disk's peak use over
its start (issue 52: at most 2.2x the bundle, counting the work folders, inductor's and Triton's
folders and every temporary file), with the stages running at that moment; the machine's GPU
memory peak (NVML); the seconds each stage waited for its turn, and why; and `cudabuild cache
stats`. Issue 52's goals at 40 layers: cold <= 20 min, no-op < 1 s, restore <= 60 s, every
stage's GPU peak <= 24 GiB. Results go to OUT/qwen_moe_real.json (and, while the build runs, what
is known so far to OUT/qwen_moe_real.live.json), the logs to OUT/logs.tar.gz.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_moe_cuda import MODEL, TARGET, Bench, du  # noqa: E402


def stage_rows(stamps: Path) -> dict:
    """Per finished stage: status, seconds, GPU peak (the allocator's), host RSS peak, bytes its
    process wrote; verify's verdict."""
    rows = {}
    for stamp in sorted(stamps.glob("*.json")):
        try:
            data = json.loads(stamp.read_text())
        except ValueError:
            continue
        value = data.get("value") or {}
        rows[stamp.stem] = {"status": data.get("status"), "seconds": data.get("seconds"),
                            "peak_gpu_gib": round(value["peak_gpu_bytes"] / 2**30, 2) if value.get("peak_gpu_bytes") else None,
                            "peak_rss_gib": round(data["peak_rss"] / 2**30, 2) if data.get("peak_rss") else None,
                            "peak_private_gib": round(data["peak_private"] / 2**30, 2) if data.get("peak_private") else None,
                            "written_gb": round(data["written_bytes"] / 1e9, 2) if data.get("written_bytes") is not None else None,
                            **({"verify": {k: value.get(k) for k in ("passed", "judged_by", "max_abs_diff", "states_compared")}}
                               if stamp.stem.startswith("verify") else {})}
    return rows


def waits(stdout: str) -> dict:
    """{stage: (seconds waited, why)} from the build's `waited Ns for its turn (why)` lines."""
    found = {}
    for line in stdout.splitlines():
        match = re.search(r"(\S+): waited (\d+)s for its turn \((.*)\)", line)
        if match:
            found[match.group(1)] = [int(match.group(2)), match.group(3)]
    return found


def gpu_used() -> int | None:
    """The GPU's used memory, all processes (NVML, through nvidia-smi), in bytes."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=10)
        return int(done.stdout.strip().splitlines()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def host_used() -> int | None:
    """The machine's memory in use, every process's (MemTotal - MemAvailable: the page cache a
    mapped weights file lives in is not counted, as it is not on a desktop that runs out)."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


class Watch:
    """While the cold build runs: the disk's used bytes (the filesystem's, so the cache, build/,
    the work folders, inductor's and Triton's folders and every temporary file count), the GPU's
    used memory (NVML, every process with its context) and the machine's memory in use, sampled
    every second, each peak with the stages running then, and the stages' rows as each ends,
    saved to `live` each time (a build cut off still leaves its numbers)."""

    def __init__(self, live: Path, stamps: Path, cache: Path, build: Path, result: dict):
        self.live, self.stamps, self.cache, self.build, self.result = live, stamps, cache, build, result
        self.start = time.monotonic()
        self.base = shutil.disk_usage(cache.parent).used
        self.peak = (0, 0.0, [])  # (bytes over the start, at second, the stages running then)
        self.gpu_peak = (0, 0.0, [])  # the card's used memory (NVML, every process): bytes, at, running
        self.host_peak = (0, 0.0, [])  # the machine's memory in use (MemTotal - MemAvailable): bytes, at, running
        self.samples: list = []
        self._stop = threading.Event()

    def running(self) -> list[str]:
        work = self.cache / "work"
        return sorted(p.name.split("-")[0] for p in work.iterdir()) if work.exists() else []

    def _loop(self) -> None:
        seen, tick = 0, 0
        while not self._stop.wait(1.0):
            tick += 1
            used = shutil.disk_usage(self.cache.parent).used - self.base
            at = round(time.monotonic() - self.start, 1)
            if used > self.peak[0]:
                self.peak = (used, at, self.running())
            gpu, host = gpu_used() or 0, host_used() or 0
            if gpu > self.gpu_peak[0]:
                self.gpu_peak = (gpu, at, self.running())
            if host > self.host_peak[0]:
                self.host_peak = (host, at, self.running())
            if tick % 10 == 0:
                self.samples.append([at, round(used / 1e9, 2), round(host / 2**30, 1), round(gpu / 2**30, 1)])
            count = len(list(self.stamps.glob("*.json"))) if self.stamps.exists() else 0
            if count != seen or tick % 30 == 0:
                seen = count
                self.save()

    def disk_summary(self, bundle: int) -> dict:
        used, at, running = self.peak
        return {"peak_used_over_start": used, "peak_at_s": at, "peak_while": running,
                "peak_over_bundle": round(used / bundle, 2) if bundle else None,
                "gpu_used_peak_gib": round(self.gpu_peak[0] / 2**30, 2), "gpu_peak_at_s": self.gpu_peak[1],
                "gpu_peak_while": self.gpu_peak[2],
                "host_used_peak_gib": round(self.host_peak[0] / 2**30, 2), "host_peak_at_s": self.host_peak[1],
                "host_peak_while": self.host_peak[2],
                "samples_disk_gb_host_gib_gpu_gib": self.samples}

    def stages(self) -> dict:
        return stage_rows(self.stamps)

    def save(self) -> None:
        live = dict(self.result, live={"seconds": round(time.monotonic() - self.start, 1), "stages": self.stages(),
                                       "disk": self.disk_summary(0)})
        tmp = self.live.with_suffix(".tmp")
        tmp.write_text(json.dumps(live, indent=1, default=str))
        os.replace(tmp, self.live)

    def __enter__(self) -> "Watch":
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--low-memory", default="ON")
    parser.add_argument("--budget", type=float, default=1500)
    parser.add_argument("--new-seed", type=int, default=None,
                        help="after the restore, the same build with seed=N: new weights for the same code (issue 57)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, args.budget)
    project, cache = bench.project("real"), bench.work / "cache-real"
    settings = ["size=35b-a3b", f"layers={args.layers}", f"low_memory_mode={args.low_memory}"]
    env = {"CUDABUILD_KERNEL_CACHE": str(bench.work / "kernels")}
    result: dict = {"layers": args.layers, "low_memory_mode": args.low_memory}

    def save():
        (out / "qwen_moe_real.json").write_text(json.dumps(result, indent=1, default=str))

    stamps = project / "build" / MODEL / TARGET / ".stamps"
    watch = Watch(out / "qwen_moe_real.live.json", stamps, cache, project / "build", result)
    with watch:
        cold = bench.build("cold", project, cache, *settings, env=env)
    stages = watch.stages()
    bundle = json.loads((stamps / "quantize.json").read_text())["value"]["files"] if (stamps / "quantize.json").exists() else {}
    result["cold"] = {"rc": cold["rc"], "seconds": cold["seconds"], "stages": stages,
                      "verify_failed": cold.get("verify_failed"), "stderr_tail": cold["stderr_tail"] if cold["rc"] else None,
                      "waits": waits((bench.logs / "cold.log").read_text() if (bench.logs / "cold.log").exists() else "")}
    bundle_bytes = bundle.get("model.safetensors", 0)
    cache_bytes, build_bytes = du(cache), du(project / "build")
    result["disk"] = {"bundle": bundle_bytes, "cache": cache_bytes, "build": build_bytes,
                      "cache_and_build_over_bundle": round((cache_bytes + build_bytes) / bundle_bytes, 2) if bundle_bytes else None,
                      **watch.disk_summary(bundle_bytes)}
    stats = subprocess.run([sys.executable, "-m", "cudabuild", "cache", "stats"], cwd=project, capture_output=True, text=True,
                           env=dict(os.environ, CUDABUILD_CACHE_DIR=str(cache), CUDABUILD_PROJECT=str(project),
                                    PYTHONPATH=f"{project}:{os.environ.get('PYTHONPATH', '')}"))
    result["cache_stats"] = stats.stdout[-3000:]
    save()
    if cold["rc"] == 0:
        noop = bench.build("noop", project, cache, *settings, env=env)
        shutil.rmtree(project / "build")
        restore = bench.build("restore", project, cache, *settings, env=env)
        result["noop"] = {"rc": noop["rc"], "seconds": noop["seconds"]}
        result["restore"] = {"rc": restore["rc"], "seconds": restore["seconds"], "statuses": restore.get("statuses")}
        save()
        if args.new_seed is not None and restore["rc"] == 0:
            with Watch(out / "qwen_moe_real.seed.live.json", stamps, cache, project / "build", {}) as seeded:
                reseed = bench.build("seed", project, cache, *settings, f"seed={args.new_seed}", env=env)
            result["new_seed"] = {"seed": args.new_seed, "rc": reseed["rc"], "seconds": reseed["seconds"],
                                  "of_cold": round(reseed["seconds"] / cold["seconds"], 3), "statuses": reseed.get("statuses"),
                                  "stages": seeded.stages(),
                                  "disk": seeded.disk_summary(bundle_bytes),
                                  "stderr_tail": reseed["stderr_tail"] if reseed["rc"] else None}
    save()
    bench.save()
    shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""ExecuTorch's Qwen3.5-MoE at the real shapes, the whole build: per stage seconds, GPU and host peaks,
disk; then a no-op and a restore.

    python bench/qwen_moe_real.py --out DIR [--layers 8] [--low-memory ON] [--budget 1500]

`doit export model=qwen_moe target=cuda size=35b-a3b layers=N low_memory_mode=M` cold (a fresh
project, cache and kernel cache), then the same again (a no-op), then `rm -rf build` and again
(every output restored from the cache). Per stage: status, seconds, `peak_gpu_bytes` (the
allocator's peak, from the stage's value), `peak_rss` (sampled); verify's verdict (judged by the
fp32 truth where the recipe has one); the bytes of the cache and of build/ against the quantize
bundle's (issue 45: at most 2.2x), and `cudabuild cache stats`. Issue 45's goals at 40 layers:
cold <= 20 min, no-op < 1 s, restore <= 60 s, every stage's GPU peak <= 24 GiB.
Results go to OUT/qwen_moe_real.json, the logs to OUT/logs.tar.gz.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_moe_cuda import MODEL, TARGET, Bench, du  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--low-memory", default="ON")
    parser.add_argument("--budget", type=float, default=1500)
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

    cold = bench.build("cold", project, cache, *settings, env=env)
    stamps = project / "build" / MODEL / TARGET / ".stamps"
    stages = {}
    for stamp in sorted(stamps.glob("*.json")):
        data = json.loads(stamp.read_text())
        value = data.get("value") or {}
        stages[stamp.stem] = {"status": data.get("status"), "seconds": data.get("seconds"),
                              "peak_gpu_gib": round(value["peak_gpu_bytes"] / 2**30, 2) if value.get("peak_gpu_bytes") else None,
                              "peak_rss_gib": round(data["peak_rss"] / 2**30, 2) if data.get("peak_rss") else None,
                              **({"verify": {k: value.get(k) for k in ("passed", "judged_by", "max_abs_diff", "states_compared")}}
                                 if stamp.stem.startswith("verify") else {})}
    bundle = json.loads((stamps / "quantize.json").read_text())["value"]["files"] if (stamps / "quantize.json").exists() else {}
    result["cold"] = {"rc": cold["rc"], "seconds": cold["seconds"], "stages": stages,
                      "verify_failed": cold.get("verify_failed"), "stderr_tail": cold["stderr_tail"] if cold["rc"] else None}
    bundle_bytes = bundle.get("model.safetensors", 0)
    cache_bytes, build_bytes = du(cache), du(project / "build")
    result["disk"] = {"bundle": bundle_bytes, "cache": cache_bytes, "build": build_bytes,
                      "cache_and_build_over_bundle": round((cache_bytes + build_bytes) / bundle_bytes, 2) if bundle_bytes else None}
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
    bench.save()
    shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()

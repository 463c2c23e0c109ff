"""cudabuild against ExecuTorch's stock exporter at the real shapes, measured side by side in one run.

    python bench/qwen_moe_side_by_side.py --out DIR [--layers 8] [--budget 1500]

The stock export.py, its --tiny-test config swapped for the real 35B-A3B one cut to `--layers`
(quantize included: min/max on the CPU as it does it), low_memory_mode OFF (ON, as shipped,
crashes in its AOTI compile on this torch), empty inductor and Triton caches; then cudabuild cold
(`doit export model=qwen_moe target=cuda size=35b-a3b layers=N low_memory_mode=OFF`, a fresh
project, cache and kernel cache). Issue 45's goal: cold/stock <= 0.7. The two models' weights
differ (the stock draw on the CPU, cudabuild's per tensor on the device), not their shapes or code.
Results go to OUT/qwen_moe_side_by_side.json, logs to OUT/logs.tar.gz.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Bench, arguments  # noqa: E402
from qwen_moe_cuda import stock_exporter  # noqa: E402


def main() -> None:
    args = arguments(__doc__, layers=8, budget=1500)
    bench = Bench(args.out, args.budget, name="qwen_moe_side_by_side")
    result: dict = {"layers": args.layers}
    bench.results = result  # what bench.save() writes to qwen_moe_side_by_side.json
    script = stock_exporter(low_memory=False, real_layers=args.layers)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(bench.work / "stock-inductor"), "TRITON_CACHE_DIR": str(bench.work / "stock-triton")}
    stock = bench.run("stock", [sys.executable, str(script), "--tiny-test", "--qlinear", "4w",
                                "--output-dir", str(bench.work / "stock-out")], bench.work, env)
    peak = re.search(r"EXPORT_GPU_PEAK_MEMORY_MB: ([\d.]+)", stock["stdout_tail"])
    result["stock"] = {"rc": stock["rc"], "seconds": stock["seconds"], "peak_gpu_mb": float(peak.group(1)) if peak else None}
    shutil.rmtree(bench.work / "stock-out", ignore_errors=True)
    project, cache = bench.project("ours"), bench.work / "cache-ours"
    ours = bench.build("cold", project, cache, "size=35b-a3b", f"layers={args.layers}", "low_memory_mode=OFF",
                       env={"CUDABUILD_KERNEL_CACHE": str(bench.work / "kernels")})
    result["cold"] = {"rc": ours["rc"], "seconds": ours["seconds"],
                      "stages": {k: (v["status"], v["seconds"]) for k, v in ours.get("stages", {}).items()}}
    if stock["rc"] == 0 and ours["rc"] == 0:
        result["cold_over_stock"] = round(ours["seconds"] / stock["seconds"], 3)
    bench.write("qwen_moe_side_by_side.json", result)
    print(json.dumps(result, default=str))
    bench.finish()


if __name__ == "__main__":
    main()

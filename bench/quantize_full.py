"""The quantize stage alone at the real shapes: seconds, peak GPU memory, peak host RSS, bundle size.

    python bench/quantize_full.py --out DIR [--layers 0] [--methods minmax,hqq] [--budget 1500]

`doit export:quantize model=qwen_moe target=cuda size=35b-a3b layers=N` (0: all 40 layers) in a
fresh project and cache per method (min/max, then HQQ with hqq=true). The streamed quantizer makes,
quantizes and writes one part at a time (cudabuild/models/qwen35_moe_quantize.py); issue 45's goals
at 40 layers on one H100/H200: min/max <= 3 min, HQQ <= 8 min. Per method: the build's seconds, the
stage's own seconds, its `peak_gpu_bytes` (the allocator's peak) and `peak_rss` (the process's
resident bytes at the stage's peak, sampled), the bundle's bytes, and what the store holds after.
Results go to OUT/quantize_full.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Bench, arguments, du  # noqa: E402


def main() -> None:
    args = arguments(__doc__, layers=0, budget=1500, extra=((("--methods",), {"default": "minmax,hqq"}),))
    bench = Bench(args.out, args.budget, name="quantize_full")
    result: dict = {"layers": args.layers or 40, "methods": {}}
    bench.results = result  # what bench.save() writes to quantize_full.json
    for method in args.methods.split(","):
        project, cache = bench.project(f"q-{method}"), bench.work / f"cache-{method}"
        settings = ["size=35b-a3b", f"layers={args.layers}"] + (["hqq=true"] if method == "hqq" else [])
        entry = bench.build(method, project, cache, *settings, tasks=("export:quantize",))
        stage = entry.get("stages", {}).get("quantize", {})
        stamp = project / "build" / "qwen_moe" / "cuda" / ".stamps" / "quantize.json"
        peak_rss = json.loads(stamp.read_text()).get("peak_rss") if stamp.exists() else None
        value = stage.get("value") or {}
        result["methods"][method] = {
            "rc": entry["rc"], "build_seconds": entry["seconds"], "stage_seconds": stage.get("seconds"),
            "peak_gpu_bytes": value.get("peak_gpu_bytes"), "peak_rss": peak_rss, "files": value.get("files"),
            "cache_bytes": du(cache), "stderr_tail": entry.get("stderr_tail") if entry["rc"] else None}
        print(json.dumps({method: result["methods"][method]}, default=str), flush=True)
        bench.write("quantize_full.json", result)
        shutil.rmtree(cache, ignore_errors=True)  # 20 GB a bundle: the next method needs the disk
        shutil.rmtree(project, ignore_errors=True)
    bench.finish()


if __name__ == "__main__":
    main()

"""How far bf16 runs stray from the fp32 truth at the real shapes, without compiling: verify's allowance.

    python bench/qwen_moe_envelope.py --out DIR [--layers 8] [--budget 540] [--tokens prefill=231144,42333]

Builds only `reference.prefill` and `reference.decode` of `size=35b-a3b layers=N` (quantize, both
exports and the references: the eager program, four bf16 runs of plain ops, the fp32 truth) in a
fresh project and cache, then reports what the stored truth says per method and step: the bf16
runs' furthest pick below the truth's best (`gaps`), their largest logit deviation from the truth
(`deviations`), the eager program's own, the truth's top logits, and verify's allowance
(cudabuild.backend.sampled_logits._allowed_gap). `--tokens` names tokens a compiled build chose
(from a failed verify's report) to see where they lie in the truth's logits: no compile needed,
since the quantized weights and verify steps are the same for the same options.
Results go to OUT/qwen_moe_envelope.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Bench, arguments  # noqa: E402


def summarise(reference: dict, tolerance: float, tokens: list[int]) -> dict:
    from cudabuild.backend import sampled_logits

    truth = reference["truth"]
    envelope, eager = truth["envelope"], truth.get("eager") or {}

    def at(per_step, i):  # a per-step list a truth stored before it existed lacks
        return per_step[i] if per_step else None

    steps = []
    for i, logits in enumerate(truth["truth"]["logits"]):
        row = logits.reshape(-1).float()
        top = row.topk(10)
        entry = {"step": i, "truth_top": [round(float(v), 4) for v in top.values],
                 "bf16_gap": envelope["gaps"][i], "bf16_deviation": at(envelope.get("deviations"), i),
                 "eager_gap": at(eager.get("gaps"), i), "eager_deviation": at(eager.get("deviations"), i),
                 "allowed": sampled_logits._allowed_gap(truth, i, tolerance)}
        if i < len(tokens):
            entry["token"] = tokens[i]
            entry["token_gap"] = float(row.max() - row[tokens[i]])
            entry["token_ok"] = entry["token_gap"] <= entry["allowed"]
        steps.append(entry)
    states = {n: {"bf16": d, "eager": eager.get("states", {}).get(n)} for n, d in sorted(envelope["states"].items())}
    return {"steps": steps, "states": states, "runs": truth.get("runs")}


def main() -> None:
    args = arguments(__doc__, layers=8, budget=540, extra=(
        (("--tokens",), {"action": "append", "default": [], "help": "METHOD=T0,T1,...: a compiled build's picks"}),
        (("--tolerance",), {"type": float, "default": 0.05})))
    picks = {m: [int(t) for t in ts.split(",")] for m, ts in (a.split("=", 1) for a in args.tokens)}
    bench = Bench(args.out, args.budget, name="qwen_moe_envelope")
    project, cache = bench.project("envelope"), bench.work / "cache-envelope"
    result: dict = {"layers": args.layers}
    bench.results = result  # what bench.save() writes to qwen_moe_envelope.json
    built = bench.build("references", project, cache, "size=35b-a3b", f"layers={args.layers}", "low_memory_mode=ON",
                        tasks=("export:reference.prefill", "export:reference.decode"))
    result["build"] = {k: built.get(k) for k in ("rc", "seconds", "stderr_tail", "stages")}
    import torch

    from cudabuild.engine.store import Store

    store = Store(cache)
    for method in ("prefill", "decode"):
        stamp = project / "build" / "qwen_moe" / "cuda" / ".stamps" / f"reference.{method}.json"
        if not stamp.exists():
            continue
        outputs = json.loads(stamp.read_text())["outputs"]
        reference = torch.load(store.objects.verified_path(outputs["reference.pt"]), weights_only=True)
        result[method] = summarise(reference, args.tolerance, picks.get(method, []))
    bench.write("qwen_moe_envelope.json", result)
    bench.finish()
    print(json.dumps({m: result[m]["steps"] for m in ("prefill", "decode") if m in result}, indent=1))


if __name__ == "__main__":
    main()

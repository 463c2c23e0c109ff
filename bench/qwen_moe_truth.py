"""Which side is wrong at the real shapes: the compiled methods and bf16 eager, each against an fp32 truth.

    python bench/qwen_moe_truth.py --out DIR [--layers 4] [--budget 560] [--cases off,on]

verify compares the compiled program with the exported program run eagerly in bf16 on ExecuTorch's
Triton kernels. At `size=35b-a3b` the two disagree by far more than bf16 rounding (issue 45), while
the compiled prefill and decode agree with each other in ExecuTorch's runtime. Which is right needs
a third opinion closer to the truth. This bench builds one:
- the quantize stage's weights (the same int4 values both sides use), dequantized to fp32;
- ExecuTorch's own model, with every Triton op answered by plain PyTorch in fp32 (the fused MoE
  expert by expert, the gated delta rule token by token, attention through the math SDPA);
- its verify steps run on it: prefill's (9 tokens, then 5) and decode's (4 single tokens).
Then the same steps run on: bf16 eager with the Triton kernels (what the reference stage does),
bf16 eager with plain-PyTorch ops (what bf16 rounding alone does), and each compiled .so of the
build (`off`: the recipe's specs, emulate_precision_casts=OFF; `on`: the same build with
emulate_precision_casts=ON, compiles only). Per method and run: every state buffer's largest
difference from the truth, relative to max(1, the truth's largest magnitude) as verify's allowance
is; each step's chosen token and how far its truth logit is below the truth's largest; and how
often each run's routing (top-k experts per token) differs from the truth's. The torch.topk that
eager uses and the Triton topk the compiled code uses (the backend replaces one by the other) are
also compared on the same router scores.

Results go to OUT/qwen_moe_truth.json, the builds' logs to OUT/logs.tar.gz. The plain ops and the
fp32 conversion are cudabuild.models.qwen35_moe_fp32's, which verify now uses too.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Bench, arguments  # noqa: E402
from qwen_moe_cuda import MODEL, TARGET, eager_model  # noqa: E402

STATE_SUFFIXES = ("conv_state", "recurrent_state", "k_cache", "v_cache")


from cudabuild.models.qwen35_moe_fp32 import PlainOps, to_fp32  # noqa: E402  (the truth verify uses)


# -- routing ------------------------------------------------------------------------------------

class Routing:
    """Records each router top-k (experts per token) and, on the same scores, what the backend's
    Triton topk picks instead."""

    def __init__(self, experts: int, k: int, compare_triton: bool):
        self.experts, self.k, self.compare_triton = experts, k, compare_triton
        self.calls: list = []
        self.triton_disagrees: list = []

    def __enter__(self):
        import torch

        self._topk = torch.topk

        def topk(scores, k, *args, **kwargs):
            out = self._topk(scores, k, *args, **kwargs)
            if k == self.k and scores.shape[-1] == self.experts:
                self.calls.append(out.indices.detach().sort(-1).values.cpu())
                if self.compare_triton:
                    _, theirs = torch.ops.triton.topk(scores, k)
                    self.triton_disagrees.append(int((theirs.sort(-1).values != out.indices.sort(-1).values).any(-1).sum()))
            return out

        torch.topk = topk
        return self

    def __exit__(self, *exc):
        import torch

        torch.topk = self._topk


# -- the runs -----------------------------------------------------------------------------------

def reset_state(model) -> None:
    for name, buf in model.named_buffers():
        if name.endswith(STATE_SUFFIXES):
            buf.zero_()


def eager_run(model, steps, compare_triton: bool = False) -> dict:
    """The steps from position 0, state kept: per step the last token's logits; the states after."""
    import torch

    config = model.config
    reset_state(model)
    routing = Routing(config.num_experts, config.num_experts_per_tok, compare_triton)
    logits = []
    with torch.no_grad(), routing:
        for tokens, pos, _ in steps:
            out = model(tokens.cuda(), pos.cuda())  # no temperature: the logits [1, T, V]
            logits.append(out[0, -1].float().cpu())
    states = {n: b.detach().float().cpu().clone() for n, b in model.named_buffers() if n.endswith(STATE_SUFFIXES)}
    return {"logits": logits, "states": states, "routing": routing.calls, "triton_topk_disagrees": routing.triton_disagrees}


def compiled_run(stamps: dict, store, method: str, steps) -> dict:
    from cudabuild.backend import sampled_logits
    from cudabuild.backend.stages.verify import load_compiled

    outputs = stamps[f"compile.{method}"]["outputs"]
    runner = load_compiled(str(store.objects.verified_path(outputs["model.so"])), str(store.objects.verified_path(outputs["weights.blob"])),
                           "cuda")
    names = [n for n in runner.extract_constants_map(False) if n.endswith(STATE_SUFFIXES)]
    tokens, states = sampled_logits.compiled_steps(runner, steps, "cuda", names)
    del runner
    return {"tokens": [int(t.reshape(-1)[0]) for t in tokens], "states": {n: s.float() for n, s in states.items()}}


def against_truth(truth: dict, run: dict) -> dict:
    """Each state's largest difference from the truth (and relative to verify's scale), each step's
    token judged by the truth's logits, and the routing that differs."""
    states = {}
    for name, want in sorted(truth["states"].items()):
        got = run["states"].get(name)
        if got is None:
            continue
        diff = float((got - want).abs().max())
        states[name] = {"diff": round(diff, 5), "rel": round(diff / max(1.0, float(want.abs().max())), 5)}
    tokens = run.get("tokens") or [int(l.argmax()) for l in run.get("logits", [])]
    steps = []
    for i, (logits, token) in enumerate(zip(truth["logits"], tokens)):
        steps.append({"token": token, "truth_argmax": int(logits.argmax()),
                      "gap": round(float(logits.max() - logits[token]), 4),
                      "scale": round(float(logits.abs().max()), 3)})
    out = {"steps": steps, "states": states,
           "worst_state": max(states.items(), key=lambda kv: kv[1]["rel"], default=(None, None))}
    if run.get("routing"):
        out["tokens_rerouted_per_call"] = [int((a != b).any(-1).sum()) for a, b in zip(truth["routing"], run["routing"])]
    return out


def analyse(project: Path, cache: Path, options: dict, stamps: dict, result: dict, out: Path) -> dict:
    """Eager bf16 (Triton), eager bf16 (plain ops), the compiled methods of `stamps`, each against
    the fp32 truth. Returns the truth per method, for later compiled runs to compare with."""
    import torch

    from cudabuild.engine.store import Store
    from cudabuild.models import qwen35_moe_cuda

    store = Store(cache)
    model = eager_model(project, cache, options)
    methods = {"decode": (qwen35_moe_cuda.prepare_decode, qwen35_moe_cuda.decode_steps(model)),
               "prefill": (qwen35_moe_cuda.prepare_prefill, qwen35_moe_cuda.prefill_steps(model))}
    runs: dict = {m: {} for m in methods}
    for method, (prepare, steps) in methods.items():
        prepare(model, options)
        t0 = time.monotonic()
        runs[method]["eager_triton"] = eager_run(model, steps, compare_triton=True)
        runs[method]["eager_triton_again"] = eager_run(model, steps)
        with PlainOps():
            runs[method]["eager_plain_bf16"] = eager_run(model, steps)
        print(f"{method}: bf16 runs {time.monotonic() - t0:.1f}s", flush=True)
    with PlainOps():
        to_fp32(model)
        for method, (prepare, steps) in methods.items():
            prepare(model, options)
            runs[method]["truth_fp32"] = eager_run(model, steps)
    del model
    torch.cuda.empty_cache()
    for method, (_, steps) in methods.items():
        runs[method]["truth_fp32"]["steps"] = steps
        runs[method]["compiled_off"] = compiled_run(stamps, store, method, steps)
        if f"reference.{method}" in stamps:  # the reference stage's own eager states (the exported program)
            ref = torch.load(store.objects.verified_path(stamps[f"reference.{method}"]["outputs"]["reference.pt"]), weights_only=True)
            runs[method]["reference_stage"] = {"states": {n: s.float() for n, s in ref["states"].items()},
                                               "tokens": [int(t.reshape(-1)[0]) for t, _ in ref["steps"]]}
    for method, named in runs.items():
        truth = named["truth_fp32"]
        result.setdefault("methods", {})[method] = {
            name: against_truth(truth, run) for name, run in named.items() if name != "truth_fp32"}
        result["methods"][method]["triton_topk_disagrees_with_torch_topk"] = named["eager_triton"]["triton_topk_disagrees"]
    return {m: named["truth_fp32"] for m, named in runs.items()}


def stamps_of(project: Path) -> dict:
    folder = project / "build" / MODEL / TARGET / ".stamps"
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def main() -> None:
    args = arguments(__doc__, layers=4, budget=560, extra=(
        (("--cases",), {"default": "off,on"}),
        (("--keep",), {"action": "store_true", "help": "keep the projects and cache (in a temp folder)"})))
    out = args.out
    bench = Bench(out, args.budget, name="qwen_moe_truth")
    project, cache = bench.project("truth"), bench.work / "cache-truth"
    settings = ["size=35b-a3b", f"layers={args.layers}", "low_memory_mode=OFF"]
    result: dict = {"layers": args.layers}
    bench.results = result  # what bench.save() writes to qwen_moe_truth.json
    save = lambda: (out / "qwen_moe_truth.json").write_text(json.dumps(result, indent=1, default=str))  # noqa: E731
    built = bench.build("off", project, cache, *settings)
    result["off"] = {k: built.get(k) for k in ("rc", "seconds", "verify", "verify_failed", "stderr_tail", "stages")}
    save()
    stamps = stamps_of(project)
    from cudabuild.models import qwen35_moe

    from cudabuild.registry import load_recipe

    stock = load_recipe(project, "qwen_moe").for_target("cuda").defaults("cuda")
    options = qwen35_moe.resolve(stock.replace(size="35b-a3b", layers=args.layers))
    # The emulate_precision_casts=ON build (compiles only) runs in a copy of the project beside the analysis.
    on_project = None
    if "on" in args.cases:
        import shutil

        on_project = bench.work / "truth-on"
        shutil.copytree(project, on_project, symlinks=True)
        thread = threading.Thread(target=lambda: result.__setitem__(
            "on", bench.build("on", on_project, cache, *settings, "emulate_precision_casts=ON")))
        thread.start()
    try:
        truth = analyse(project, cache, options, stamps, result, out)
    except Exception as e:  # keep what the builds measured
        import traceback

        result["analysis_error"] = traceback.format_exc()[-3000:]
        truth = None
        print(f"analysis failed: {e}", flush=True)
    save()
    if on_project is not None:
        thread.join(timeout=max(bench.left(), 1))
        on = result.get("on") or {}
        result["on"] = {k: on.get(k) for k in ("rc", "seconds", "verify", "verify_failed", "stderr_tail", "stages")}
        if truth is not None and on.get("stages", {}).get("compile.decode", {}).get("status") == "ran":
            from cudabuild.engine.store import Store

            store, on_stamps = Store(cache), stamps_of(on_project)
            for method, want in truth.items():
                run = compiled_run(on_stamps, store, method, want["steps"])
                result["methods"][method]["compiled_on"] = against_truth(want, run)
    result["seconds"] = time.monotonic() - bench.start
    save()
    bench.finish(keep=args.keep)  # gigabytes of cache otherwise: the machine's next case needs the disk


if __name__ == "__main__":
    main()

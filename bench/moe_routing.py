"""How far ExecuTorch's Qwen3.5-MoE moves under its own bf16 rounding: routing free, and pinned.

    python bench/moe_routing.py --out DIR [--layers 2] [--trials 4] [--package]

A compiled program rounds differently from eager PyTorch (inductor fuses a norm with the residual
add in fp32, for one), so the two are never bit-equal. Where a token's top-k experts are nearly
tied, a last-bit difference picks another expert, and that token's MoE output changes by a whole
expert's share: not rounding any more, yet not a miscompile either. This bench measures that on
the eager model itself (the quantize stage's weights at `size=35b-a3b layers=N`, on the GPU):
verify's prefill steps run once as they are, then `--trials` times with layer 0's post-attention
norm output perturbed by relative noise of 2^-9 (below one bf16 ulp: about half its elements move
by one ulp), each trial twice: the routing free, and the routing pinned to the unperturbed run's
experts (torch.topk answered with the recorded indices). Per trial: how many tokens changed their
experts, and each state buffer's largest difference against verify's allowance (0.05 times
max(1, its largest magnitude)). --package first builds the whole package (its verify report kept).
Results go to OUT/moe_routing.json. Measured on the H200 at layers=2 (docs/qwen_moe_cuda.md, third
session): 0-1 token rerouted per MoE call, every state within 0.04 of the unperturbed run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_moe_cuda import Bench, eager_model  # noqa: E402

from cudabuild.backend.stages.verify import TOLERANCES  # noqa: E402

NOISE = 2.0 ** -9
TOLERANCE = TOLERANCES["bfloat16"]  # verify's allowance for a bf16 model's states


class Routing:
    """torch.topk inside the MoE blocks, recorded (indices per call) or pinned to a recording."""

    def __init__(self, experts: int, k: int):
        self.experts, self.k = experts, k
        self.recorded: list = []
        self.margins: list = []
        self.pinned: list | None = None
        self._calls = 0

    def __enter__(self):
        import torch

        self._topk = torch.topk

        def topk(scores, k, *args, **kwargs):
            if k != self.k or scores.shape[-1] != self.experts:
                return self._topk(scores, k, *args, **kwargs)
            values, indices = self._topk(scores, k + 1, *args, **kwargs)
            self.margins.append((values[..., k - 1] - values[..., k]).float().cpu())
            values, indices = values[..., :k], indices[..., :k]
            if self.pinned is not None:
                indices = self.pinned[self._calls].to(scores.device)
                values = scores.gather(-1, indices)
            self.recorded.append(indices.cpu())
            self._calls += 1
            return torch.return_types.topk((values, indices))

        torch.topk = topk
        return self

    def __exit__(self, *exc):
        import torch

        torch.topk = self._topk


def run_steps(model, steps, perturb_seed: int | None, routing: Routing) -> tuple:
    """The steps from position 0, state kept between them: (last logits, {buffer: value})."""
    import torch

    hook = None
    if perturb_seed is not None:
        generator = torch.Generator(device="cuda").manual_seed(perturb_seed)

        def perturbed(module, inputs, out):
            noise = torch.randn(out.shape, device=out.device, generator=generator)
            return (out.float() * (1 + NOISE * noise)).to(out.dtype)

        hook = model.layers[0].ln_2.register_forward_hook(perturbed)
    try:
        with torch.no_grad(), routing:
            for tokens, pos, _ in steps:
                logits = model(tokens.cuda(), pos.cuda())
    finally:
        if hook is not None:
            hook.remove()
    states = {name: b.detach().float().cpu().clone() for name, b in model.named_buffers()
              if name.endswith(("conv_state", "recurrent_state"))}
    return logits[0, -1].float().cpu(), states


def compare(base: tuple, other: tuple, base_routing: Routing, other_routing: Routing) -> dict:
    logits, states = base
    o_logits, o_states = other
    flips = [int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
             for a, b in zip(base_routing.recorded, other_routing.recorded)]
    rows = {}
    for name, want in states.items():
        diff = float((o_states[name] - want).abs().max())
        allowed = TOLERANCE * max(1.0, float(want.abs().max()))
        rows[name] = {"max_abs_diff": diff, "allowed": allowed, "ok": diff <= allowed}
    return {"tokens_rerouted_per_call": flips, "states": rows,
            "logits_max_abs_diff": float((o_logits - logits).abs().max()),
            "same_argmax": int(o_logits.argmax()) == int(logits.argmax()),
            "states_failing": sorted(n for n, r in rows.items() if not r["ok"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--package", action="store_true")
    parser.add_argument("--budget", type=float, default=560)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, args.budget)
    project, cache = bench.project("routing"), bench.work / "cache-routing"
    settings = ["size=35b-a3b", f"layers={args.layers}", "low_memory_mode=OFF"]
    result: dict = {"layers": args.layers, "noise": NOISE}
    if args.package:
        entry = bench.build("package", project, cache, *settings)
        result["package"] = {k: entry.get(k) for k in ("rc", "seconds", "verify", "verify_failed", "stderr_tail", "stages")}
    else:
        entry = bench.build("quantize", project, cache, *settings, tasks=("export:quantize",))
        result["quantize"] = {k: entry.get(k) for k in ("rc", "seconds", "stderr_tail")}
    (out / "moe_routing.json").write_text(json.dumps(result, indent=1, default=str))

    from cudabuild.models import qwen35_moe
    from cudabuild.options import defaults
    from cudabuild.registry import load_recipe

    stock = defaults(load_recipe(project, "qwen_moe").options, "cuda")
    options = qwen35_moe.resolve(dict(stock, size="35b-a3b", layers=args.layers), stock)
    t0 = time.monotonic()
    model = eager_model(project, cache, options)
    qwen35_moe.prepare_prefill(model, options)
    steps = qwen35_moe.prefill_steps(model)
    config = model.config
    result["load_seconds"] = time.monotonic() - t0

    def routing():
        return Routing(config.num_experts, config.num_experts_per_tok)

    base_routing = routing()
    base = run_steps(model, steps, None, base_routing)
    again_routing = routing()
    again = run_steps(model, steps, None, again_routing)
    result["repeat"] = compare(base, again, base_routing, again_routing)  # eager against itself: 0
    result["routing_margins"] = [{"tokens": int(m.numel()), "min": float(m.min()), "median": float(m.median()),
                                  "under_1e-3": int((m < 1e-3).sum())} for m in base_routing.margins]
    trials = []
    for seed in range(args.trials):
        free_routing = routing()
        free = compare(base, run_steps(model, steps, seed, free_routing), base_routing, free_routing)
        pinned_routing = routing()
        pinned_routing.pinned = base_routing.recorded
        pinned = compare(base, run_steps(model, steps, seed, pinned_routing), base_routing, pinned_routing)
        trials.append({"seed": seed, "free": free, "pinned": pinned})
        print(f"trial {seed}: rerouted {free['tokens_rerouted_per_call']}, failing free {free['states_failing']}, "
              f"pinned {pinned['states_failing']}", flush=True)
    result["trials"] = trials
    result["seconds"] = time.monotonic() - bench.start
    (out / "moe_routing.json").write_text(json.dumps(result, indent=1, default=str))
    bench.save()


if __name__ == "__main__":
    main()

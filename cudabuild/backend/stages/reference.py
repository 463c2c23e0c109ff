"""reference: one method's exported program run eagerly on the target's device, which is what
verify compares the compiled code with.

On a device this is the costlier half of verifying. ExecuTorch's Qwen3.5-MoE, tiny, on the H200:
80 s of verify.prefill's 83 s, as its Triton ops (flash-linear-attention's chunked kernels, the
fused MoE) compile and autotune their kernels on first use. It depends on the export alone, so as
a stage of its own it runs beside the method's edge and compile instead of after them, and a
change to edge or compile specs finds it in the cache. On the CPU the eager run is cheap and uses
the cores the compiles use, so verify runs it itself (`compute`) and a CPU build has no such stage.

What is stored (`reference.pt`, tensors only, loaded with weights_only): for a method that
returns its outputs, `outputs`; for one that samples its token inside the program
(cudabuild.backend.sampled_logits), `steps` ([(token, logits)] per verify step) and `states`
(its buffers after the last step). Beside them are `computed_in`, the precision the method
computes in, and `buffers`, the buffers a sampling method's state is compared on. verify then
needs neither the program nor its weights. Where the recipe's quantizer declares an fp32 truth
(`Quantize.truth`: ExecuTorch's Qwen3.5-MoE), `truth` holds it: the same steps in fp32 on the same
weights, and how far bf16 runs stray from them (cudabuild.models.qwen35_moe_fp32), computed after
the eager program is let go, so the two models are never on the device together.
"""

from __future__ import annotations

from pathlib import Path

from cudabuild.backend import custom_ops, device_peak, kernel_cache
from cudabuild.backend.cuda_env import scoped_environ
from cudabuild.backend.programs import load_example_inputs, load_program
from cudabuild.backend.stages.export import release_model
from cudabuild.engine.memory import collect_if_worth
from cudabuild.engine.context import StageResult
from cudabuild.engine.console.trace import phase

FILE = "reference.pt"


def device_of(target: str) -> str:
    return "cuda" if target == "cuda" else "cpu"


def sampler_of(ctx) -> dict | None:
    return (ctx.config.description.get("samplers") or {}).get(ctx.stage.method)


def compute(ctx, device: str) -> dict:
    """The method's eager results on `device`, from its stored export (see the module docstring)."""
    import torch

    from cudabuild.backend import sampled_logits

    method = ctx.stage.method
    with phase("load"):
        ep = load_program(ctx.reader("export", method))  # weights mapped from the store
    sampler = sampler_of(ctx)
    # The eager program's Triton ops compile their kernels on first use: from the shared cache.
    with phase("eager"), scoped_environ(kernel_cache.environment(ctx.cache_root)):
        steps = None
        if sampler:
            steps = torch.load(ctx.blob_path("export", method, "verify_steps.pt"), weights_only=True)
            eager, states = sampled_logits.eager_steps(ep, steps, device, sampler["temperature_input"])
            result = {"steps": eager, "states": states, "buffers": sampled_logits.program_buffers(ep)}
        else:
            inputs = load_example_inputs(ctx.blob("export", method, "inputs.pt"))
            result = {"outputs": eager_outputs(ep, inputs, device)}
    result["computed_in"] = str(compute_dtype(ep, result.get("outputs", []))).removeprefix("torch.")
    # The program's weights are unmapped before the compiled code gets its own: one copy of a big
    # model at a time. Its graph module holds reference cycles, so that takes a collection (a
    # fraction of a second with torch loaded: only where the weights are worth it).
    held = sum(t.nbytes for t in ep.state_dict.values())
    del ep
    collect_if_worth(held)
    if sampler and "weights" in ctx.inputs:
        truth = _truth(ctx, device, steps, result)
        if truth is not None:
            result["truth"] = truth
    return result


def _truth(ctx, device: str, steps: list, result: dict) -> dict | None:
    """The recipe's fp32 truth of these steps (cudabuild.recipe.Quantize.truth), or None."""
    from cudabuild.backend.stages.export import quantized_folder

    config = ctx.config
    recipe = ctx.recipe
    if recipe.quantize is None or recipe.quantize.truth is None:
        return None
    method = next(m for m in recipe.methods if m.name == ctx.stage.method)
    eager = {"tokens": [int(token.reshape(-1)[0]) for token, _ in result["steps"]],
             "logits": [logits for _, logits in result["steps"]], "states": result["states"]}
    with phase("truth"), scoped_environ(kernel_cache.environment(ctx.cache_root)):
        return recipe.quantize.truth(config.options, quantized_folder(ctx), method.prepare or (lambda m, o: None),
                                     steps, device, eager)


def eager_outputs(ep, inputs: tuple, device: str) -> list:
    """The program run eagerly, on the target's device: a big model's reference (and Triton ops in
    an edge program) need the GPU, where only its state is held throughout and its weights are
    copied op by op (cudabuild.backend.streamed_eager). Outputs come back on the CPU, as a list."""
    from cudabuild.backend.sampled_logits import program_buffers
    from cudabuild.backend.streamed_eager import StreamedProgram

    out, _ = StreamedProgram(ep, device, resident=program_buffers(ep)).run(tuple(inputs))
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    return [t.detach().to("cpu") for t in out]


def compute_dtype(ep, outputs: list):
    """The precision the method computes in: the narrowest floating dtype of its weights (a bf16
    model's logits come out as float32 but carry bf16's error), else of its outputs."""
    dtypes = {t.dtype for t in ep.state_dict.values() if t.dtype.is_floating_point}
    dtypes |= {t.dtype for t in outputs if t.dtype.is_floating_point}
    return narrowest(dtypes)


def narrowest(dtypes):
    """The floating dtype of fewest bits (the first of them on a tie), float32 if there is none."""
    import torch

    return min(dtypes, key=lambda d: torch.finfo(d).bits, default=torch.float32)


def load(path: Path | str) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def run(ctx) -> StageResult:
    import torch

    device = device_of(ctx.config.target)
    release_model()
    custom_ops.register(ctx.config.target)  # the ops its program calls
    device_peak.start(device)  # what it holds on the device: the runner's admission reads it
    result = compute(ctx, device)
    path = ctx.workdir / FILE
    torch.save(result, path)
    if device == "cuda":
        torch.cuda.empty_cache()
    return StageResult({FILE: path}, value={"computed_in": result["computed_in"], **device_peak.peak(device)})

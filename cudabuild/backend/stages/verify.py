"""verify: run one method's compiled .so and weights blob (the blob stage's: the code compiled once,
the blob for this build's weights) through torch's AOTI runner and compare its outputs with eager
execution of the exported program, within a per-dtype tolerance. The eager results are the
reference stage's on a device target, else computed here (cudabuild.backend.stages.reference).
The edge program it compares constants with is the one for this build's weights
(cudabuild.backend.stages.blob.lowered_program).

The .so is built without libtorch (link_libtorch=False), so its `aoti_torch_*` symbols resolve only
if libtorch is loaded with RTLD_GLOBAL: torch loads it RTLD_LOCAL, so the library is promoted first.
Constants are loaded from the blob before the first run (running first crashes).
"""

from __future__ import annotations

import gc
import json
import os

from cudabuild.errors import VerifyFailed, one_line
from cudabuild.backend import aoti_constants, mapped_weights
from cudabuild.backend.aoti_constants import promote_libtorch
from cudabuild.backend import custom_ops, device_peak
from cudabuild.backend.programs import StoredWeights, load_example_inputs, program_tensors
from cudabuild.backend.stages import reference
from cudabuild.backend.stages.blob import lowered_program, lowered_tensors
from cudabuild.backend.stages.export import release_model
from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.context import StageResult
from cudabuild.engine.console.trace import phase

# Max |diff| allowed relative to max(1, max |eager|), per output dtype. Recipes may override.
TOLERANCES = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def load_compiled(so_path: str, blob_path: str, device: str):
    """torch's AOTI runner for the .so, with its constants loaded from the weights blob."""
    import torch

    promote_libtorch(device)
    if device == "cuda":
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so_path, 1, "cuda:0")
        # Its constants: one cudaMalloc of the blob's size, outside torch's allocator.
        device_peak.held_outside(os.path.getsize(blob_path))
    else:
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so_path, 1)
    runner.update_constant_buffer_from_blob(blob_path)
    return runner


def run_compiled(so_path: str, blob_path: str, inputs: tuple, device: str) -> list:
    return load_compiled(so_path, blob_path, device).run([t.to(device) for t in inputs])


def constants_unlike_program(so_path: str, blob_path: str, ep, device: str) -> tuple[int, list[str]]:
    """Load the blob into a fresh runner and compare every constant it names with the program's
    tensor of the same FQN: (how many were compared, the FQNs whose values differ). Read before
    any run, so mutated buffers (KV caches) still hold their initial values. Constants inductor
    made itself (folded or prepacked, no FQN of the program or another shape) are not compared."""
    import torch

    reference = program_tensors(ep)
    # The extracted tensors are views of the runner's constant memory: keep the runner alive.
    runner = load_compiled(so_path, blob_path, device)
    loaded = runner.extract_constants_map(False)
    compared, unlike = 0, []
    for fqn, value in sorted(loaded.items()):
        want = reference.get(fqn)
        if want is None or tuple(want.shape) != tuple(value.shape):
            continue
        compared += 1
        if not torch.equal(value.detach().to("cpu", want.dtype), want.detach().to("cpu")):
            unlike.append(fqn)
    return compared, unlike


def run(ctx) -> StageResult:
    import torch

    method, target = ctx.stage.method, ctx.config.target
    device = reference.device_of(target)
    release_model()
    custom_ops.register(ctx.config.target)  # the ops its programs call
    device_peak.start(device)  # what it holds on the device: the runner's admission reads it
    # Where the build has a reference stage (a device target), the eager results are its output;
    # elsewhere they are computed here, the same way.
    if "reference" in ctx.inputs:
        with phase("load"):
            expected = reference.load(ctx.blob_path("reference", method, reference.FILE))
    else:
        expected = reference.compute(ctx, device)
    sampler = reference.sampler_of(ctx)
    if sampler:
        return _verify_sampling_method(ctx, expected, device)
    inputs = load_example_inputs(ctx.blob("export", method, "inputs.pt"))
    outputs = expected["outputs"]
    compute = getattr(torch, expected["computed_in"])
    so = ctx.fetch("blob", method, "model.so", ctx.workdir / "model.so")
    # A file of the weights blob while the compiled code runs and a mismatch is located: the
    # store's own, or a copy of one it keeps as ranges of others, gone after (ObjectStore.blob_file).
    with ctx.blob_file("blob", method, "weights.blob") as blob:
        return _judge_outputs(ctx, method, inputs, outputs, compute, so, blob, device)


def _judge_outputs(ctx, method: str, inputs: tuple, outputs: list, compute, so, blob, device: str) -> StageResult:
    with phase("compiled"):
        actual, report_load = run_compiled_lean(ctx, method, str(so), blob, inputs, device)
    tolerances = dict(TOLERANCES, **ctx.config.description.get("tolerances", {}))
    report = {"outputs": [], "passed": True, "constants_from": report_load}
    for i, (want, got) in enumerate(zip(outputs, actual)):
        got = got.detach().to("cpu")
        dtype = str(want.dtype).removeprefix("torch.")
        precision = reference.narrowest((want.dtype, compute)) if want.dtype.is_floating_point else want.dtype
        scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
        allowed = tolerances.get(str(precision).removeprefix("torch."), 1e-4) * scale
        ok = got.shape == want.shape and diff <= allowed
        report["outputs"].append({"index": i, "dtype": dtype, "computed_in": str(precision).removeprefix("torch."),
                                  "shape": list(want.shape), "max_abs_diff": diff, "allowed": allowed, "ok": ok})
        report["passed"] &= ok
    if len(actual) != len(outputs):
        report["passed"] = False
    path = ctx.workdir / "verify.json"
    path.write_text(json.dumps(report, indent=1))
    if not report["passed"]:
        worst = max(report["outputs"], key=lambda o: o["max_abs_diff"] / max(o["allowed"], 1e-30), default={})
        where = _locate_fault(ctx, method, inputs, outputs, worst.get("index") or 0, device, (str(so), str(blob)), report)
        report["fault"] = where
        _keep_failed_report(ctx, method, report)
        raise VerifyFailed(
            f"method {method}: compiled output {worst.get('index')} differs from eager by {worst.get('max_abs_diff'):.3g} "
            f"(allowed {worst.get('allowed'):.3g}); {where}"
        )
    summary = {"max_abs_diff": max((o["max_abs_diff"] for o in report["outputs"]), default=0.0), "passed": True,
               **device_peak.peak(device)}
    return StageResult({"verify.json": path}, value=summary)


def _verify_sampling_method(ctx, expected: dict, device: str) -> StageResult:
    """A method that draws its token inside the program: its logits and state are compared over
    its verify steps (cudabuild.backend.sampled_logits), at the greedy temperature."""
    import torch

    from cudabuild.backend import sampled_logits

    method = ctx.stage.method
    steps = torch.load(ctx.blob_path("export", method, "verify_steps.pt"), weights_only=True)
    tolerances = dict(TOLERANCES, **ctx.config.description.get("tolerances", {}))
    tolerance = tolerances.get(expected["computed_in"], 1e-4)
    so = ctx.fetch("blob", method, "model.so", ctx.workdir / "model.so")
    with phase("compiled"), ctx.blob_file("blob", method, "weights.blob") as blob:
        runner = load_compiled(str(so), str(blob), device)
        compiled, compiled_states = sampled_logits.compiled_steps(runner, steps, device, expected["buffers"])
        del runner
    report = sampled_logits.judge(expected["steps"], compiled, expected["states"], compiled_states, tolerance,
                                  truth=expected.get("truth"))
    report["computed_in"] = expected["computed_in"]
    path = ctx.workdir / "verify.json"
    path.write_text(json.dumps(report, indent=1))
    if not report["passed"]:
        _keep_failed_report(ctx, method, report)
        wrong = report.get("reference", {}).get("worst")
        if wrong is not None:
            raise VerifyFailed(f"method {method}: the eager reference itself is wrong: {wrong['buffer']} lies "
                               f"{wrong['diff']:.3g} from the fp32 truth, where bf16 runs lie at most "
                               f"{wrong['bf16_truth_diff']:.3g} (allowed {wrong['allowed']:.3g}); the compiled code is not judged")
        bad = next((s for s in report["steps"] if not s["ok"]), None)
        if bad is not None and "truth_gap" in bad:
            raise VerifyFailed(f"method {method}: at step {bad['step']} the compiled code chose token "
                               f"{bad['compiled_token']}, whose fp32-truth logit is {bad['truth_gap']:.3g} below the largest "
                               f"(token {bad['truth_argmax']}; bf16 runs' furthest {bad['bf16_truth_gap']:.3g}, "
                               f"allowed {bad['allowed']:.3g})")
        if bad is not None:
            raise VerifyFailed(f"method {method}: at step {bad['step']} the compiled code chose token "
                               f"{bad['compiled_token']}, whose eager logit is {bad['logit_gap']:.3g} below the largest "
                               f"(token {bad['eager_argmax']}; allowed {bad['allowed']:.3g})")
        state = next((s for s in report["states"] if not s["ok"]), None)
        if state is not None and "truth_diff" in state:
            what = (f"its state {state['buffer']} lies {state['truth_diff']:.3g} from the fp32 truth (bf16 runs' furthest "
                    f"{state['bf16_truth_diff']:.3g}, allowed {state['allowed']:.3g})")
        elif state is not None:
            what = f"its state {state['buffer']} differs from eager by {state['max_abs_diff']:.3g} (allowed {state['allowed']:.3g})"
        else:
            what = "its steps did not all run"
        raise VerifyFailed(f"method {method}: {what}")
    worst = max([s["logit_gap"] for s in report["steps"]] + [s["max_abs_diff"] for s in report["states"]], default=0.0)
    summary = {"max_abs_diff": worst, "passed": True, "steps": len(report["steps"]),
               "states_compared": report["states_compared"], "judged_by": report["judged_by"], **device_peak.peak(device)}
    return StageResult({"verify.json": path}, value=summary)


def run_compiled_lean(ctx, method: str, so: str, blob, inputs: tuple, device: str) -> tuple[list, str]:
    """The compiled method's outputs, and how its constants were loaded.

    On the CPU, the edge program's weights (what the .so was compiled from), mapped from the store,
    are handed to the runner as user-managed constants, once the weights blob is checked to hold
    exactly their bytes where the .so reads them (cudabuild.backend.aoti_constants): the same
    numbers as loading the blob, without the runner's second copy of every weight. Elsewhere, or
    when the check cannot be made, the blob is loaded the ordinary way.
    """
    import torch

    if device != "cpu":
        return run_compiled(so, str(blob), inputs, device), "loaded from the weights blob"
    promote_libtorch(device)
    stored = StoredWeights()
    tensors = lowered_tensors(ctx, method, stored)  # fresh buffers (KV caches): eager wrote into its own
    mapped = mapped_weights.Mapped(stored.tensors())
    table = aoti_constants.constants_table(so)
    problem = aoti_constants.check_blob(blob, table, tensors, mapped) or (
        "the .so folds constants" if any(c.folded for c in table) else None)
    if problem:
        del tensors, stored, mapped
        gc.collect()
        return run_compiled(so, str(blob), inputs, device), f"loaded from the weights blob ({problem})"
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
    runner.update_constant_buffer({c.name: tensors[c.fqn] for c in table}, False, True, True)
    outputs = [t.clone() for t in runner.run(list(inputs))]
    # torch's runner never lets go of user-managed constants (nor their mapping) once given them:
    # hand the pages back, so the rest of the build does not carry this method's weights.
    mapped.drop_all()
    return outputs, "the edge program's weights, mapped; the weights blob holds exactly their bytes"


def _locate_fault(ctx, method: str, inputs: tuple, expected: list, index: int, device: str,
                  compiled: tuple[str, str], report: dict) -> str:
    """On a mismatch, narrow down where it arose, in pipeline order: the stored edge program run
    eagerly (wrong already before AOTInductor: edge lowering or its serialization), then the
    constants the weights blob loads against the edge program's (wrong weights or an
    uninitialised cache), else the compiled code itself."""
    try:
        edge = lowered_program(ctx, method)
    except Exception as e:  # a diagnostic only: never hide the verify failure behind it
        return f"the edge program could not be loaded to locate the fault ({one_line(e)})"
    # Compare constants before the eager run: it writes into the program's KV caches (on the CPU
    # the module shares the program's tensors).
    try:
        constants = constants_unlike_program(*compiled, edge, device)
    except Exception as e:
        constants = e
    try:
        got = reference.eager_outputs(edge, inputs, device)
        diff = (got[index].float() - expected[index].float()).abs().max().item()
    except Exception as e:
        return f"the edge program could not be run eagerly to locate the fault ({one_line(e)})"
    if diff > 1e-4 * max(1.0, expected[index].abs().max().item()):
        return f"the edge program already differs by {diff:.3g}: the fault is before the compile (edge lowering or its serialization)"
    if isinstance(constants, Exception):
        return f"the edge program matches eager (|diff| {diff:.3g}); its constants could not be compared ({type(constants).__name__})"
    compared, unlike = constants
    report["constants"] = {"compared": compared, "unlike_edge_program": unlike}
    if unlike:
        named = ", ".join(unlike[:3]) + (f" and {len(unlike) - 3} more" if len(unlike) > 3 else "")
        return (f"the edge program matches eager (|diff| {diff:.3g}) but the weights blob loads {len(unlike)} of "
                f"{compared} constants with other values ({named}): the fault is in the compile's constants")
    return (f"the edge program matches eager (|diff| {diff:.3g}) and the weights blob loads all {compared} "
            f"constants exactly: the fault is in the compiled code")


def _keep_failed_report(ctx, method: str, report: dict) -> None:
    """A failed verify caches nothing, so leave its numbers where a person can read them."""
    atomic_write_text(ctx.config.build_dir / f"verify-{method}.failed.json", json.dumps(report, indent=1))

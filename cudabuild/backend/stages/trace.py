"""trace: build the recipe's model and torch.export one method: the traced program, for any weights
of its layout.

The stage is keyed on the code and the weights' layout, not their values (cudabuild.pipeline: the
options but those the recipe's table marks `values_only`, the quantize stage's `layout` facet instead of its
digest): tracing the same code again gives the same graph, whatever the weights hold. It stores
what torch.export gave (programs.save_program: graph, signature, weights, constants, example
inputs) and what the recipe's functions give for the model (the method's verify steps, the
constant methods' metadata), and beside them `layout.json`: each weight's layout (FQN, dtype,
shape, strides, class: programs.weight_layout) and the model's state entries the program does not
take. Its value names the weights it was traced with (`weights`: eager_model.weights_of); the
export stage hands the program on where those are the build's, and binds the build's weights into
it otherwise, without tracing (cudabuild.backend.stages.export).
"""

from __future__ import annotations

import contextlib
import json

# ExecuTorch (for save_program), imported with this module: the runner imports a stage's module
# before the stage waits for its turn (cudabuild.engine.workers), so a worker that waits spends the
# wait on this import (7 s) instead of its turn.
import executorch.exir.serde.serialize  # noqa: F401

from cudabuild.backend.eager_model import build_model, release_model, weights_of
from cudabuild.backend.programs import weight_layout
from cudabuild.backend.stages.program_result import program_result
from cudabuild.engine.console.trace import phase
from cudabuild.engine.context import StageResult
from cudabuild.errors import ExportFailed, one_line

LAYOUT = "layout.json"


def layout(ep, model) -> dict:
    """What another model's weights must match to be bound into `ep` (see the module docstring)."""
    state = model.state_dict(keep_vars=True)
    return {"weights": {fqn: weight_layout(t) for fqn, t in sorted(ep.state_dict.items())},
            "untaken": sorted(set(state) - set(ep.state_dict))}


def traced(ctx, recipe, model, reuse) -> StageResult:
    """The method traced from `model` (weights `reuse` knows are named, not written again), with
    its verify steps, metadata and layout: the trace stage's result, and the export stage's where
    it cannot bind."""
    import torch

    method = next(m for m in recipe.methods if m.name == ctx.stage.method)
    try:
        if method.prepare is not None:
            method.prepare(model, ctx.config.options)
        inputs = tuple(method.inputs(model))
        shapes = method.dynamic_shapes(model) if method.dynamic_shapes else None
        # A model whose own exporter traces it strictly (TorchDynamo), under no_grad, is exported so.
        with phase("torch.export"), torch.no_grad() if recipe.strict_export else contextlib.nullcontext():
            ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=recipe.strict_export)
    except Exception as e:
        raise ExportFailed(f"method {method.name} of {ctx.config.model} failed to export: {one_line(e)}") from e
    result = program_result(ep, ctx.workdir, reuse, keep=ctx.keep)
    if method.verify_steps is not None:
        # What verify runs, in order, on one loaded program (it has the program, not the model).
        result.files["verify_steps.pt"] = ctx.workdir / "verify_steps.pt"
        torch.save([tuple(step) for step in method.verify_steps(model)], result.files["verify_steps.pt"])
    metadata = dict(recipe.constant_methods(model)) if recipe.constant_methods else {}
    result.files["metadata.json"] = ctx.workdir / "metadata.json"
    result.files["metadata.json"].write_text(json.dumps(metadata, sort_keys=True))
    result.files[LAYOUT] = ctx.workdir / LAYOUT
    result.files[LAYOUT].write_text(json.dumps(layout(ep, model), sort_keys=True))
    return result


def run(ctx) -> StageResult:
    with phase("load"):  # the model built, its checkpoint read
        recipe, model, reuse = build_model(ctx)
    result = traced(ctx, recipe, model, reuse)
    result.value["weights"] = weights_of(ctx)
    if ctx.workers > 1:
        # The next method's stage may run in another worker, and an idle worker's model would
        # count against no stage's admission (cudabuild.engine.workers): let it go now.
        release_model()
    return result

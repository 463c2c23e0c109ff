"""export: build the recipe's model and torch.export one method; store the program and its graph hash."""

from __future__ import annotations

import contextlib
import json

# ExecuTorch (for save_program), imported with this module: the runner imports a stage's module
# before the stage waits for its turn (cudabuild.engine.workers), so a worker that waits spends the
# wait on this import (7 s) instead of its turn.
import executorch.exir.serde.serialize  # noqa: F401

from cudabuild.errors import CudabuildError, ExportFailed, one_line
from cudabuild.engine.hashing import canonical_json
from cudabuild.backend import custom_ops
from cudabuild.backend.programs import StoredWeights
from cudabuild.backend.stages.program_result import program_result
from cudabuild.engine.context import StageResult
from cudabuild.engine.console.trace import phase

# The eager model of the latest (model, options) this process exported: all methods export the
# same module, and targets of one model share it. Only the latest is kept: a process runs one
# build's stages together (builds one after another; each `doit -n` worker is its own process),
# so an earlier model would only hold memory (tens of GB for a real checkpoint), and a later
# return to it costs one rebuild, which gives the same weights (seeded, or the checkpoint's).
# Beside the model, the weight files its first export wrote (programs.StoredWeights): every method exports
# the same parameters, so the next method names those files instead of writing them again.
_MODELS: dict = {}


def release_model() -> None:
    """Forget the eager model. Stages after export call this first: a real checkpoint's model is
    as big as every later stage's working set, and holding both would double the build's memory
    (verify's eager reference runs the stored exported program instead)."""
    _MODELS.clear()


def build_model(ctx):
    config = ctx.config
    weights = ctx.inputs.get("weights")  # the quantize stage's digest, where the recipe quantizes
    key = (config.model, config.target, canonical_json(dict(config.options)), weights)
    if key not in _MODELS:
        _MODELS.clear()  # before building: the old and the new model need not fit together
        recipe = ctx.recipe
        custom_ops.register(config.target)  # the ops the model's forward calls (ExecuTorch's Triton ops on cuda)
        try:
            if recipe.quantize is not None:
                model = recipe.quantize.load(dict(config.options), quantized_folder(ctx))
            else:
                model = recipe.build(dict(config.options))
            _MODELS[key] = (recipe, model, StoredWeights())
        except CudabuildError:
            raise
        except Exception as e:
            raise ExportFailed(f"model {config.model} failed to build: {one_line(e)}") from e
    return _MODELS[key]


def quantized_folder(ctx):
    """The quantize stage's outputs as one folder, by their names: links to the store's own
    (verified, read-only) files, which the loader maps or reads."""
    folder = ctx.workdir / "quantized"
    folder.mkdir()
    for name in ctx.upstream("quantize").outputs:
        (folder / name).symlink_to(ctx.blob_path("quantize", None, name))
    return folder


def run(ctx) -> StageResult:
    import torch

    with phase("load"):  # the model built, its checkpoint read
        recipe, model, reuse = build_model(ctx)
    method = next(m for m in recipe.methods if m.name == ctx.stage.method)
    try:
        if method.prepare is not None:
            method.prepare(model, dict(ctx.config.options))
        inputs = tuple(method.inputs(model))
        shapes = method.dynamic_shapes(model) if method.dynamic_shapes else None
        # A model whose own exporter traces it strictly (TorchDynamo), under no_grad, is exported so.
        with torch.no_grad() if recipe.strict_export else contextlib.nullcontext():
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
    if ctx.workers > 1:
        # The next method's export may run in another worker, and an idle worker's model would
        # count against no stage's admission (cudabuild.engine.workers): let it go now.
        release_model()
    return result

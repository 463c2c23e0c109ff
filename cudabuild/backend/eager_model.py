"""The recipe's eager model, as the trace and export stages build it, and which weights it holds.

Both stages build the model: trace to torch.export it, export to take its weights (and, where it
must, to trace it). `build_model` keeps the latest one in the process, keyed on `weights_of`: all
methods take the same module, and a stage of the next method in the same process finds it.
`weights_of` is the digest of everything that decides the built model, its weights' values
included: the model, its recipe's sources, every option, the quantize stage's result where the
recipe quantizes, and the checkpoint's content. Two builds with the same `weights_of` build the
same model with the same weights, which is how the export stage knows that the traced program
holds this build's weights already (cudabuild.backend.stages.export).

Owns the model cache and that digest. Must not touch: tracing (stages/trace.py), storing programs
(programs.py).
"""

from __future__ import annotations

from cudabuild.backend import custom_ops
from cudabuild.backend.programs import StoredWeights
from cudabuild.engine.hashing import digest
from cudabuild.errors import CudabuildError, ExportFailed, one_line

# The eager model of the latest `weights_of` this process built: all methods take the same
# module, and targets of one model share it. Only the latest is kept: a process runs one build's
# stages together (builds one after another; each `doit -n` worker is its own process), so an
# earlier model would only hold memory (tens of GB for a real checkpoint), and a later return to
# it costs one rebuild, which gives the same weights (seeded, or the checkpoint's). Beside the
# model, the weight files its first stage wrote (programs.StoredWeights): every method has the
# same parameters, so the next method names those files instead of writing them again.
_MODELS: dict = {}


def release_model() -> None:
    """Forget the eager model. Stages after export call this first: a real checkpoint's model is
    as big as every later stage's working set, and holding both would double the build's memory
    (verify's eager reference runs the stored exported program instead)."""
    _MODELS.clear()


def quantizes(ctx) -> bool:
    """Whether the build's model comes from the quantize stage (the recipe's form declares one)."""
    return bool(ctx.config.description.get("quantize"))


def weights_of(ctx) -> str:
    """The digest of what decides the eager model this build's stage would build (the module
    docstring): the same for the trace and the export stage of one build."""
    config = ctx.config
    return digest({
        "model": config.model, "target": config.target, "options": dict(config.options),
        "sources": dict(config.description.get("sources") or {}),
        "quantized": ctx.upstream("quantize").digest if quantizes(ctx) else None,
        "checkpoint": ctx.checkpoint_digest(),
    })


def build_model(ctx):
    """(recipe, model, StoredWeights) for the build's `weights_of`, built once per process."""
    config = ctx.config
    key = weights_of(ctx)
    if key not in _MODELS:
        _MODELS.clear()  # before building: the old and the new model need not fit together
        recipe = ctx.recipe
        custom_ops.register(config.target)  # the ops the model's forward calls (ExecuTorch's Triton ops on cuda)
        try:
            if recipe.quantize is not None:
                model = recipe.quantize.load(config.options, quantized_folder(ctx))
            else:
                model = recipe.build(config.options)
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

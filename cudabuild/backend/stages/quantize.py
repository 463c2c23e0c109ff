"""quantize: the recipe's weights prepared once, ahead of every method's export (`Quantize.run`).

What decides them is in the stage's key (cudabuild.pipeline): the quantization options, the
weights' content, the quantizer's source and the toolchain. Its outputs are the files the
recipe's quantizer wrote (for ExecuTorch's Qwen3.5-MoE a stock-format bundle: model.safetensors
and config.json); every trace and export loads them through the recipe's `Quantize.load`. Its
value's facet `layout` is their layout without their values (`layout_digest`), which the trace
stage keys on.
"""

from __future__ import annotations

from pathlib import Path

from cudabuild.backend import device_peak
from cudabuild.backend.eager_model import release_model
from cudabuild.engine.context import StageResult
from cudabuild.engine.console.trace import phase
from cudabuild.errors import CudabuildError, ExportFailed, one_line
from cudabuild.engine.hashing import digest, sha256_file
from cudabuild.formats.safetensors_parts import tensor_layouts, tensor_regions


def run(ctx) -> StageResult:
    import torch

    config = ctx.config
    recipe = ctx.recipe
    device = "cuda" if config.target == "cuda" and recipe.quantize.on_device else "cpu"
    release_model()
    device_peak.start(device)
    try:
        with phase("quantize"):
            written = recipe.quantize.run(config.options, ctx.workdir / "weights", device)
    except CudabuildError:
        raise
    except Exception as e:
        raise ExportFailed(f"model {config.model} failed to quantize: {one_line(e)}") from e
    files = {name: Path(path) for name, path in written.items()}
    value = {"files": {name: path.stat().st_size for name, path in sorted(files.items())}, "device": device}
    value.update(device_peak.peak(device))
    if device == "cuda":
        torch.cuda.empty_cache()
    # The bundle's tensors, by where they lie in it: the exports' weight files repeat them, and are
    # then kept as ranges of the bundle (cudabuild.engine.spans) instead of a second copy.
    regions = {name: tensor_regions(path) for name, path in files.items() if name.endswith(".safetensors")}
    value["facets"] = {"layout": layout_digest(files)}
    return StageResult(files, value=value, regions=regions)


def layout_digest(files: dict[str, Path]) -> str:
    """The prepared weights' layout: each .safetensors file's tensors by name, dtype and shape (and
    its header's metadata: how torchao's subclasses were flattened), every other file (config.json)
    by its content. The trace stage keys on it (the `layout` facet), so new weights of the same
    layout trace nothing."""
    return digest({name: tensor_layouts(path) if name.endswith(".safetensors") else sha256_file(path)
                   for name, path in sorted(files.items())})

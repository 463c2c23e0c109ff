"""The quantize stage of ExecuTorch's Qwen3.5-MoE: its weights quantized once, a part at a time, and
written as a bundle in the stock format.

Owns the quantization, as the stock exporter's `_quantize` does it, and the bundle:
`model.safetensors` (torchao's flattened tensor subclasses, as ExecuTorch's quantize_and_save writes
it) beside a Hugging Face `config.json`, or a stock bundle adopted where it lies
(`prequantized=DIR`). Export loads it with the stock prequantized loader (qwen35_moe_cuda.py), and
so can the stock exporter (`export.py --prequantized DIR`). Must not touch: where the weights come
from (qwen35_moe_weights.py: the sizes' draws, a checkpoint), anything a method, an export or a
compile decides. The quantize stage is keyed on this module's source and what it imports from the
project, so what lives here reruns quantization when it changes; keep the per-method switches and
the runtime buffers elsewhere.

Quantization, step by step as ExecuTorch 1.4.1's export.py `_quantize` (it is not called as is
because it moves layers to "cuda" unconditionally; here the device is a parameter, so the same
steps run on the CPU where torchao can, as the tests do with qlinear=8w):
1. experts: packed int4 (min/max, or HQQ with `hqq`), ExecuTorch's `_quantize_experts_int4`;
2. lm_head untied from the embedding;
3. each layer moved to the device in bf16, its linears quantized (4w: torchao's tile-packed int4,
   the layout `_weight_int4pack_mm` reads), moved back;
4. lm_head likewise; 5. the embedding (`qembedding`); 6. the final norm cast to bf16.
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path
import torch

from cudabuild.models import qwen35_moe_weights as weights

BUNDLE = "model.safetensors"
CONFIG = "config.json"
ADOPTED = "bundle.json"  # names a stock prequantized bundle used in place


def check_bundle(folder: Path) -> None:
    """A stock CUDA bundle: config.json, and a model.safetensors whose header says how to rebuild
    its tensor subclasses (torchao's `tensor_names`, or the legacy `quantization`)."""
    from cudabuild.errors import InvalidOption
    from cudabuild.formats.safetensors_parts import METADATA, HeaderError, read_raw_header

    for name in (CONFIG, BUNDLE):
        if not (folder / name).is_file():
            raise InvalidOption(f"prequantized={folder}", f"no {name} there (a bundle of ExecuTorch's quantize_and_save has both)")
    try:
        header, _, _ = read_raw_header(folder / BUNDLE)
    except HeaderError as e:
        raise InvalidOption(f"prequantized={folder}", f"{BUNDLE} is not readable ({e})") from None
    metadata = header.get(METADATA) or {}
    if "tensor_names" not in metadata and "quantization" not in metadata:
        raise InvalidOption(f"prequantized={folder}", f"{BUNDLE} is not a quantized bundle (its header has no torchao "
                            "tensor_names)", fix="make one with ExecuTorch's quantize_and_save.py")


def _release(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


# -- the streamed quantizer: one part of the model at a time ----------------------------------------
#
# Each part of `weights.weight_parts` (made on the device) is quantized there, moved to the host and
# handed to the bundle's writer, which writes it while the next part is made: the device holds about
# one layer (or the lm_head) at a time, the host one part, never the whole bf16 model.


def _quantize_part(prefix: str, module, config, options) -> None:
    """The stock `_quantize`'s steps for one part, in place, where the part lies: a layer's experts
    to packed int4 and its linears (as the lm_head's) by `qlinear`; the embedding by `qembedding`."""
    from executorch.examples.models.qwen3_5_moe.export import _quantize_experts_int4
    from executorch.extension.llm.export.quantize import quantize_model_

    qlinear, group = options.qlinear, options.qlinear_group_size
    packing = "tile_packed_to_4d" if qlinear == "4w" else None
    if prefix.startswith("layers."):
        _quantize_experts_int4(types.SimpleNamespace(layers=[module]), config, group, use_hqq=options.hqq)
        quantize_model_(module, qlinear_config=qlinear, qlinear_group_size=group, qlinear_packing_format=packing)
    elif "lm_head" in module:
        quantize_model_(module, qlinear_config=qlinear, qlinear_group_size=group, qlinear_packing_format=packing)
    elif "embed_tokens" in module and options.qembedding:
        quantize_model_(module, qembedding_config=options.qembedding)


def _flattened(prefix: str, module) -> tuple[dict, dict]:
    """The part's bundle tensors in torchao's flattened form (plain tensors, and metadata that
    rebuilds the subclasses), named from the model's root."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    items = list(module.named_parameters()) + list(module.named_buffers())
    state = {}
    for name, t in items:
        full = prefix + name
        if any(marker in full for marker in weights.RUNTIME_BUFFERS) or full in state:
            continue
        state[full] = t.data if isinstance(t, torch.nn.Parameter) else t
    return flatten_tensor_state_dict(state)


def quantize_streamed(options, config, path: Path, device: str) -> dict:
    """Make, quantize and write every part in turn; the bundle at `path`. Returns what it measured."""
    from cudabuild.formats.safetensors_stream import SafetensorsStream

    names: list[str] = []
    started = time.monotonic()
    timings = {"make": 0.0, "quantize": 0.0, "hand_off": 0.0}
    with SafetensorsStream(path, expected_tensors=64 * (config.num_hidden_layers + 4)) as out:
        parts = weights.weight_parts(options, config, device)
        while True:
            t0 = time.monotonic()
            part = next(parts, None)
            if part is None:
                break
            prefix, module = part
            t1 = time.monotonic()
            _quantize_part(prefix, module, config, options)
            _synchronize(device)
            t2 = time.monotonic()
            tensors, metadata = _flattened(prefix, module)
            names += json.loads(metadata.pop("tensor_names"))
            out.metadata.update(metadata)
            out.add(tensors)
            del module, tensors
            _release(device)
            timings["make"] += t1 - t0
            timings["quantize"] += t2 - t1
            timings["hand_off"] += time.monotonic() - t2
        out.metadata["tensor_names"] = json.dumps(names)
    timings["seconds"] = time.monotonic() - started
    return {k: round(v, 2) for k, v in timings.items()}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def quantize(options, folder: Path, device: str) -> dict[str, Path]:
    """Build and quantize the model the options describe, a part at a time; write the bundle into
    `folder`. A stock prequantized bundle (`prequantized=DIR`) is adopted as it is: `bundle.json`
    names it, and its tensors key this stage like a checkpoint's."""
    folder.mkdir(parents=True, exist_ok=True)
    if options.prequantized:
        bundle = Path(options.prequantized).expanduser().resolve()
        check_bundle(bundle)
        files = {ADOPTED: folder / ADOPTED}
        files[ADOPTED].write_text(json.dumps({"folder": str(bundle)}))
        return files
    config = weights.model_config(options)
    files = {BUNDLE: folder / BUNDLE, CONFIG: folder / CONFIG}
    quantize_streamed(options, config, files[BUNDLE], device)
    files[CONFIG].write_text(json.dumps(weights.hf_config(config), indent=1, sort_keys=True))
    return files

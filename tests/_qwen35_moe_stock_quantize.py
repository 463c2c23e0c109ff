"""ExecuTorch's stock whole-model `_quantize` (export.py), run on the CPU: the reference the build's
streamed quantizer (cudabuild/models/qwen35_moe_quantize.py) is checked against, tensor for tensor.

Owns nothing a build runs; tests/test_qwen35_moe.py calls it. Must not touch: the bundle's writing.
"""

from __future__ import annotations

import torch

from cudabuild.models.qwen35_moe_quantize import _release
from cudabuild.models.qwen35_moe_weights import RUNTIME_BUFFERS


def _on(module, device: str, dtype=None) -> None:
    """Move the module's submodules that hold no meta buffer (the runtime state a checkpoint leaves
    unloaded) to `device`; ExecuTorch's `_to_device_skip_meta`, which moves tensor subclasses right."""
    from executorch.examples.models.qwen3_5_moe.export import _to_device_skip_meta

    _to_device_skip_meta(module, device=device, dtype=dtype)


def quantize_model(model, config, options, device: str) -> None:
    """The stock exporter's `_quantize` on a whole model, in place, with the linears quantized on
    `device`: the reference the streamed quantizer is checked against (tests), not the build's path."""
    from executorch.examples.models.qwen3_5_moe.export import _quantize_experts_int4
    from executorch.extension.llm.export.quantize import quantize_model_

    qlinear, group = options.qlinear, options.qlinear_group_size
    packing = "tile_packed_to_4d" if qlinear == "4w" else None
    _quantize_experts_int4(model, config, group, use_hqq=options.hqq)
    if model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr():
        model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.clone())
    for layer in model.layers:
        _on(layer, device, torch.bfloat16)
        quantize_model_(layer, qlinear_config=qlinear, qlinear_group_size=group, qlinear_packing_format=packing)
        _on(layer, "cpu")
        _release(device)
    model.lm_head.to(device=device, dtype=torch.bfloat16)
    wrapper = torch.nn.ModuleDict({"lm_head": model.lm_head})
    quantize_model_(wrapper, qlinear_config=qlinear, qlinear_group_size=group, qlinear_packing_format=packing)
    model.lm_head = wrapper.lm_head
    model.lm_head.to(device="cpu")
    _release(device)
    if options.qembedding:
        model.embed_tokens.to(dtype=torch.bfloat16)
        quantize_model_(model, qembedding_config=options.qembedding)
    model.norm.to(dtype=torch.bfloat16)


def weights(model) -> list[tuple[str, torch.Tensor]]:
    """What the bundle holds: every parameter and buffer but the runtime state."""
    items = list(model.named_parameters()) + list(model.named_buffers())
    return [(name, t) for name, t in items if not any(marker in name for marker in RUNTIME_BUFFERS)]

"""ExecuTorch's own Qwen3.5-MoE (executorch.examples.models.qwen3_5_moe) as the cuda form of
recipes/qwen_moe.py, loaded and prepared as its exporter (export.py) prepares it.

Owns what happens after the weights are quantized (qwen35_moe_quantize.py): loading a bundle into a
meta model with `assign` (the stock prequantized loader), the runtime buffers, the per-method
switches (decode: the vec-mat MoE kernel and int4 matvec; prefill: the batched tensor-core MoE
kernel, tinygemm or dequant dense linears), the methods' inputs (`tokens`, `input_pos`,
`temperature`) and verify steps, and the bundle's projected bytes (`weights_bytes`). Must not
touch: where the weights come from (qwen35_moe_weights.py), their quantization, the CPU form
(qwen35_moe_plain.py), the options' checks (qwen35_moe.py `resolve`).

The model itself is ExecuTorch's, unchanged: its forward calls ExecuTorch's Triton ops (fused MoE,
the chunked and the fused-decode delta rule, split-K decode attention, int4 matvec), so it runs on
a CUDA device only; it exports anywhere (the ops have fake kernels).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import torch

from cudabuild.models import qwen35_moe_quantize as quant
from cudabuild.models import qwen_moe_checkpoint as checkpoint_fields
from cudabuild.models.qwen35_moe import BUNDLE_BASE, BUNDLE_PER_LAYER
from cudabuild.models.qwen35_moe_sizes import depth, kept_layers

# A bf16 checkpoint quantized to int4 with a bf16 scale and zero per 32 weights: 0.625 of 2 bytes.
_INT4_OF_BF16 = 0.3125


def weights_bytes(options) -> int:
    """About the bytes of the quantized bundle these (resolved) options give: what the build keeps
    of its weights, once cached and once in the .ptd (cudabuild.engine.room projects its disk from
    it). From the measured 35b-a3b bundle by layer, a checkpoint's files, a bundle's own size."""
    if options.prequantized:
        return sum(f.stat().st_size for f in _folder(options.prequantized).glob("*.safetensors"))
    if options.checkpoint:
        folder = _folder(options.checkpoint)
        checkpoint = sum(f.stat().st_size for f in folder.glob("*.safetensors")) * _INT4_OF_BF16
        config = checkpoint_fields.read_config(folder)[0] or {}
        total = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers") or 0
        return int(checkpoint * (kept_layers(options.layers, total) / total if total else 1))
    size = options.size
    layers = kept_layers(options.layers, depth(size))
    return BUNDLE_BASE.get(size, 0) + BUNDLE_PER_LAYER.get(size, 0) * layers


def _folder(path: str) -> Path:
    return Path(path).expanduser().resolve()


def load(options, folder) -> torch.nn.Module:
    """The eager model from the quantize stage's output (`folder`: its files by name), built on the
    meta device and given the bundle's tensors with `assign` (ExecuTorch's load_prequantized_model),
    its runtime buffers made real; with dense_prefill=dequant, the dense int4 linears re-packed for
    the dequant prefill (on the GPU, as the stock exporter does). Its forward calls ExecuTorch's
    Triton ops: the caller registers them first (cudabuild.backend.custom_ops.register("cuda"), as
    the export and reference stages do), so a model imports nothing of the backend."""
    from executorch.examples.models.qwen3_5_moe.export import (
        _materialize_buffers, _replace_dense_with_w4dequant, load_prequantized_model,
    )

    adopted = os.path.join(folder, quant.ADOPTED)
    if os.path.isfile(adopted):
        with open(adopted) as f:
            folder = json.load(f)["folder"]
    model, config = load_prequantized_model(str(folder), max_seq_len=options.max_seq_len,
                                            use_splitk_decode=options.splitk)
    _materialize_buffers(model, config)
    if options.dense_prefill == "dequant":
        _replace_dense_with_w4dequant(model, group_size=options.qlinear_group_size, use_hqq=options.hqq)
    return model


def prepare_decode(model, options) -> None:
    from executorch.examples.models.qwen3_5_moe.export import _set_batched_moe, _set_dequant_prefill

    _set_batched_moe(model, False)
    _set_dequant_prefill(model, False)


def prepare_prefill(model, options) -> None:
    from executorch.examples.models.qwen3_5_moe.export import _set_batched_moe, _set_dequant_prefill

    _set_batched_moe(model, True, moe_activation_dtype=options.moe_activation_dtype)
    _set_dequant_prefill(model, options.dense_prefill == "dequant")


def _temperature(value: float = 1.0) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def decode_inputs(model) -> tuple:
    return (torch.tensor([[0]], dtype=torch.long), torch.tensor([0], dtype=torch.long), _temperature())


def prefill_inputs(model) -> tuple:
    # T = max_seq_len - 1: AOTInductor sizes the chunked delta rule's buffers from the example, and a
    # shorter one would refuse longer prompts at run time (the stock exporter's reason).
    T = model.config.max_seq_len - 1
    return (torch.zeros((1, T), dtype=torch.long), torch.arange(T, dtype=torch.long), _temperature())


def prefill_shapes(model):
    T = torch.export.Dim("seq_len", min=2, max=model.config.max_seq_len - 1)
    return ({1: T}, {0: T}, None)


def _tokens(n: int, vocab: int, start: int = 0) -> torch.Tensor:
    return (torch.arange(start, start + n, dtype=torch.long) * 37 + 11) % vocab


GREEDY = 1e-6


def decode_steps(model) -> list[tuple]:
    """Four decode calls from position 0: a runner's first tokens, the state carried between them."""
    vocab = model.config.vocab_size
    return [(_tokens(1, vocab, i)[None, :], torch.tensor([i]), _temperature(GREEDY)) for i in range(4)]


def prefill_steps(model) -> list[tuple]:
    """A 9-token prompt, then 5 more tokens continuing from its state (a chunked prompt)."""
    vocab, longest = model.config.vocab_size, model.config.max_seq_len - 1
    first, second = min(9, longest), min(5, longest - min(9, longest))
    steps = [(_tokens(first, vocab)[None, :], torch.arange(first), _temperature(GREEDY))]
    if second >= 2:
        steps.append((_tokens(second, vocab, first)[None, :], torch.arange(first, first + second), _temperature(GREEDY)))
    return steps

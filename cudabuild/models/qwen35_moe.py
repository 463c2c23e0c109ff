"""ExecuTorch's own Qwen3.5-MoE (executorch.examples.models.qwen3_5_moe) for its CUDA backend,
prepared as its exporter (export.py) prepares it.

Owns what happens after the weights are quantized (cudabuild/models/qwen35_moe_quantize.py):
loading a bundle into a meta model with `assign` (the stock prequantized loader), the runtime
buffers, the per-method switches (decode: the vec-mat MoE kernel and int4 matvec; prefill: the
batched tensor-core MoE kernel, tinygemm or dequant dense linears), the methods' inputs
(`tokens`, `input_pos`, `temperature`), the runner's metadata, and which combinations of the
options it can take (the options themselves, with their types and defaults, are the recipe's table).

The model itself is ExecuTorch's, unchanged: its forward calls ExecuTorch's Triton ops (fused MoE,
the chunked and the fused-decode delta rule, split-K decode attention, int4 matvec), so it runs on
a CUDA device only; it exports anywhere (the ops have fake kernels). Its CPU form is the same
model through a source transformation that swaps those modules for plain PyTorch
(cudabuild/models/qwen35_moe_plain.py). Both forms share `resolve` (here: one function, every
problem collected) and the runner's metadata.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

from cudabuild.errors import InvalidConfig, InvalidOption, compose
from cudabuild.models import qwen35_moe_quantize as quant
from cudabuild.models import qwen_moe_checkpoint as checkpoint_fields

# The KV cache's length when a size or checkpoint does not say: the stock exporter's --max-seq-len;
# also the cap on a checkpoint's own context (262144 for Qwen3.5, far beyond what a build needs).
DEFAULT_MAX_SEQ_LEN = 4096
# prefill's T ranges over [2, max_seq_len - 1], which torch.export needs non-empty and not one value.
MIN_SEQ_LEN = 4
# The layers of a size that does not say: Qwen35MoEConfig's default, 35B-A3B's 40.
DEFAULT_LAYERS = 40
# The options that decide the quantized weights (the quantize stage's key); the folders too.
QUANTIZE_OPTIONS = ("size", "layers", "seed", "qlinear", "qlinear_group_size", "qembedding", "hqq")
QUANTIZE_FOLDERS = ("checkpoint", "prequantized")
# The CPU form's delta-rule prefill chunk when `chunk` is left at 0: the size's, or for a checkpoint
# 64 (the 35b-a3b size's, and FLA's kernels').
CHUNKS = {"tiny": 8, "35b-a3b": 64}
CHECKPOINT_CHUNK = 64
# What a prequantized bundle decides by itself: these must stay at their defaults beside it.
DECIDED_BY_A_BUNDLE = ("layers", "qlinear", "qlinear_group_size", "qembedding", "hqq")


def resolve(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict:
    """The options with max_seq_len (and on the CPU, chunk) filled in; every combination the model
    cannot take refused, all at once, for either form. `defaults` are the options' defaults (the
    recipe's table: the stock exporter's). A checkpoint's config.json and the tensors it implies
    are checked here, as a bundle's config.json is (cudabuild/models/qwen_moe_checkpoint.py, the
    fields ExecuTorch's model reads)."""
    out = dict(options)
    problems = []
    # `layers` is >= 0 by the option table; here only what the table cannot know is checked: that
    # the weights' source (a size, a checkpoint) has that many.
    layers, source, depth = int(options["layers"]), "", None
    if options.get("checkpoint") and options.get("prequantized"):
        problems.append(compose("qwen_moe options checkpoint= and prequantized= exclude each other",
                                "a bundle is already the quantized checkpoint"))
    if options.get("prequantized"):
        fixed = [f"{name}={options[name]}" for name in DECIDED_BY_A_BUNDLE if options[name] != defaults[name]]
        if fixed:
            problems.append(compose(f"qwen_moe option prequantized= decides {', '.join(DECIDED_BY_A_BUNDLE)} by itself",
                                    fix=f"drop {', '.join(fixed)}"))
        else:
            try:
                quant.check_bundle(_folder(options["prequantized"]))
                config, found = checkpoint_fields.read_config(_folder(options["prequantized"]))
                problems += found or checkpoint_fields.checked_fields(
                    config, str(_folder(options["prequantized"]) / quant.CONFIG))[1]
            except InvalidOption as e:
                problems.append(str(e))
    if options.get("dense_prefill") == "dequant" and options.get("qlinear") != "4w":
        problems.append(compose(f"qwen_moe option dense_prefill=dequant needs qlinear=4w (int4 dense weights), "
                                f"not qlinear={options['qlinear']}"))
    max_seq_len = int(options["max_seq_len"])
    if options.get("checkpoint"):
        fields, found = checkpoint_fields.check_checkpoint(options["checkpoint"], layers)
        problems += found
        source, depth = "the checkpoint", fields.get("num_hidden_layers")
        limit = fields.get("max_position_embeddings")
        if limit and max_seq_len > limit:
            problems.append(compose(f"qwen_moe option max_seq_len={max_seq_len}",
                                    f"the checkpoint's max_position_embeddings is {limit}"))
        max_seq_len = max_seq_len or min(limit or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)
    elif not options.get("prequantized"):
        source, depth = f"the size {options['size']}", quant.SIZES[options["size"]].get("num_hidden_layers", DEFAULT_LAYERS)
        max_seq_len = max_seq_len or quant.SIZES[options["size"]].get("max_seq_len", 0)
    if depth is not None and layers > depth:
        problems.append(compose(f"qwen_moe option layers={layers}", f"{source} has {depth}"))
    max_seq_len = max_seq_len or DEFAULT_MAX_SEQ_LEN
    if max_seq_len < MIN_SEQ_LEN:
        problems.append(compose(f"qwen_moe option max_seq_len={max_seq_len}",
                                expected=f"an integer >= {MIN_SEQ_LEN} (default 0: from the checkpoint or the size)"))
    if problems:
        raise InvalidConfig(problems)
    out["max_seq_len"] = max_seq_len
    if "chunk" in options:  # the CPU form's plain delta rule: its prefill chunk
        chunk = int(options["chunk"]) or (CHECKPOINT_CHUNK if options.get("checkpoint") else CHUNKS[options["size"]])
        out["chunk"] = min(chunk, max_seq_len)
    return out


# The quantized bundle of the 35b-a3b size (min/max, qlinear=4w, group 32), measured on the H100:
# 20,382,819,592 B at 40 layers and 5.14 GB at 8, so the embedding and the lm_head take about
# 1.33 GB and a layer (its 256 int4 experts, mostly) about 0.476 GB.
_BUNDLE_BASE, _BUNDLE_PER_LAYER = {"35b-a3b": 1_329_000_000}, {"35b-a3b": 476_300_000}
# A bf16 checkpoint quantized to int4 with a bf16 scale and zero per 32 weights: 0.625 of 2 bytes.
_INT4_OF_BF16 = 0.3125


def weights_bytes(options: Mapping[str, Any]) -> int:
    """About the bytes of the quantized bundle these (resolved) options give: what the build keeps
    of its weights, once cached and once in the .ptd (cudabuild.engine.room projects its disk from
    it). From the measured 35b-a3b bundle by layer, a checkpoint's files, a bundle's own size."""
    if options.get("prequantized"):
        return sum(f.stat().st_size for f in _folder(options["prequantized"]).glob("*.safetensors"))
    if options.get("checkpoint"):
        folder = _folder(options["checkpoint"])
        checkpoint = sum(f.stat().st_size for f in folder.glob("*.safetensors")) * _INT4_OF_BF16
        config = checkpoint_fields.read_config(folder)[0] or {}
        total = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers") or 0
        layers = int(options.get("layers") or 0)
        return int(checkpoint * (min(layers, total) / total if layers and total else 1))
    size = options.get("size", "tiny")
    layers = int(options.get("layers") or 0) or quant.SIZES[size].get("num_hidden_layers", DEFAULT_LAYERS)
    return _BUNDLE_BASE.get(size, 0) + _BUNDLE_PER_LAYER.get(size, 0) * layers


# The CPU form keeps the weights unquantized: bf16 for 35b-a3b, about 3.56x the int4 bundle's
# bytes a layer (2 bytes a weight against 0.5625), and the embedding and lm_head at 1.02 GB each.
_BF16_BASE, _BF16_OF_INT4 = {"35b-a3b": 2_034_000_000}, 2 / 0.5625


def plain_weights_bytes(options: Mapping[str, Any]) -> int:
    """About the bytes of the CPU form's weights (weights_bytes' counterpart): a checkpoint's
    files, or the 35b-a3b size's bf16 weights by layer; tiny's are a few MB (0: not projected)."""
    if options.get("checkpoint"):
        folder = _folder(options["checkpoint"])
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    size = options.get("size", "tiny")
    layers = int(options.get("layers") or 0) or quant.SIZES[size].get("num_hidden_layers", DEFAULT_LAYERS)
    return int(_BF16_BASE.get(size, 0) + _BUNDLE_PER_LAYER.get(size, 0) * _BF16_OF_INT4 * layers)


def _folder(path: str):
    from pathlib import Path

    return Path(path).expanduser().resolve()


def load(options: Mapping[str, Any], folder) -> torch.nn.Module:
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
    model, config = load_prequantized_model(str(folder), max_seq_len=int(options["max_seq_len"]),
                                            use_splitk_decode=bool(options["splitk"]))
    _materialize_buffers(model, config)
    if options["dense_prefill"] == "dequant":
        _replace_dense_with_w4dequant(model, group_size=int(options["qlinear_group_size"]), use_hqq=bool(options["hqq"]))
    return model


def prepare_decode(model, options: Mapping[str, Any]) -> None:
    from executorch.examples.models.qwen3_5_moe.export import _set_batched_moe, _set_dequant_prefill

    _set_batched_moe(model, False)
    _set_dequant_prefill(model, False)


def prepare_prefill(model, options: Mapping[str, Any]) -> None:
    from executorch.examples.models.qwen3_5_moe.export import _set_batched_moe, _set_dequant_prefill

    _set_batched_moe(model, True, moe_activation_dtype=options["moe_activation_dtype"])
    _set_dequant_prefill(model, options["dense_prefill"] == "dequant")


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


def runner_metadata(max_seq_len: int, vocab_size: int, n_layers: int, mutable_buffers: list[str]) -> dict:
    """The constant methods ExecuTorch's Qwen3.5-MoE runner reads, for either form of the model."""
    return {
        "get_max_seq_len": max_seq_len,
        "get_vocab_size": vocab_size,
        "get_n_layers": n_layers,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,
        # The per-session state a runner resets and shares between methods by name.
        "get_mutable_buffer_metadata": json.dumps({"version": 1, "mutable_buffers": mutable_buffers}),
    }


def metadata(model) -> dict:
    from executorch.examples.models.qwen3_5_moe.export import _qwen_mutable_buffer_fqns

    config = model.config
    return runner_metadata(config.max_seq_len, config.vocab_size, config.num_hidden_layers,
                           _qwen_mutable_buffer_fqns(model))

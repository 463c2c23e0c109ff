"""What the two forms of ExecuTorch's Qwen3.5-MoE share (recipes/qwen_moe.py): the options resolved
before any stage, and the runner's metadata.

Owns `resolve`: max_seq_len (and on the CPU, chunk) filled in, every combination of the options the
model cannot take refused at once, a checkpoint's config.json and tensors checked against one table
(qwen_moe_checkpoint.py, the fields ExecuTorch's model reads), a prequantized bundle's too; and the
constant methods ExecuTorch's runner reads; what the weights measure (both forms' `weights_bytes`
project from it). Must not touch: the weights, the quantization, either
form's model (qwen35_moe_cuda.py, qwen35_moe_plain.py): the options themselves, with their types and
defaults, are the recipe's table.
"""

from __future__ import annotations

import json
from pathlib import Path

from cudabuild.errors import InvalidConfig, InvalidOption, compose
from cudabuild.models import qwen35_moe_quantize as quant
from cudabuild.models import qwen35_moe_sizes as sizes
from cudabuild.models import qwen_moe_checkpoint as checkpoint_fields

# The KV cache's length when a size or checkpoint does not say: the stock exporter's --max-seq-len;
# also the cap on a checkpoint's own context (262144 for Qwen3.5, far beyond what a build needs).
DEFAULT_MAX_SEQ_LEN = 4096
# prefill's T ranges over [2, max_seq_len - 1], which torch.export needs non-empty and not one value.
MIN_SEQ_LEN = 4
# What the weights measure, for both forms' projections of a build's disk (`weights_bytes`), kept
# here rather than beside the sizes: the quantize stage is not keyed on them. The quantized bundle of
# the 35b-a3b size (min/max, qlinear=4w, group 32), measured on the H100:
# 20,382,819,592 B at 40 layers and 5.14 GB at 8, so the embedding and the lm_head take about
# 1.33 GB and a layer (its 256 int4 experts, mostly) about 0.476 GB.
BUNDLE_BASE, BUNDLE_PER_LAYER = {"35b-a3b": 1_329_000_000}, {"35b-a3b": 476_300_000}
# Unquantized (bf16) the same size is about 3.56x the int4 bundle's bytes a layer (2 bytes a weight
# against 0.5625), and the embedding and lm_head take 1.02 GB each.
BF16_BASE, BF16_OF_INT4 = {"35b-a3b": 2_034_000_000}, 2 / 0.5625
# The CPU form's delta-rule prefill chunk when `chunk` is left at 0: the size's, or for a checkpoint
# 64 (the 35b-a3b size's, and FLA's kernels').
CHUNKS = {"tiny": 8, "35b-a3b": 64}
CHECKPOINT_CHUNK = 64


def resolve(options):
    """The options with max_seq_len (and on the CPU, chunk) filled in; every combination the model
    cannot take refused, all at once, for either form. What a prequantized bundle decides by itself
    (the rows the recipe's table marks `decided_by` it) must stay at its default beside it. A
    checkpoint's config.json and the tensors it implies are checked here, as a bundle's config.json
    is (cudabuild/models/qwen_moe_checkpoint.py, the fields ExecuTorch's model reads)."""
    problems = []
    # `layers` is >= 0 by the option table; here only what the table cannot know is checked: that
    # the weights' source (a size, a checkpoint) has that many.
    layers, source, depth = options.layers, "", None
    if options.checkpoint and options.prequantized:
        problems.append(compose("qwen_moe options checkpoint= and prequantized= exclude each other",
                                "a bundle is already the quantized checkpoint"))
    decided = options.decided()  # {prequantized: (what a bundle decides, those given other values)}
    for decider, (names, fixed) in decided.items():
        if fixed:
            problems.append(compose(f"qwen_moe option {decider}= decides {', '.join(names)} by itself",
                                    fix=f"drop {', '.join(fixed)}"))
    if options.prequantized and not any(fixed for _, fixed in decided.values()):
        bundle = _folder(options.prequantized)
        try:
            quant.check_bundle(bundle)
            config, found = checkpoint_fields.read_config(bundle)
            problems += found or checkpoint_fields.checked_fields(config, str(bundle / quant.CONFIG))[1]
        except InvalidOption as e:
            problems.append(str(e))
    if options.dense_prefill == "dequant" and options.qlinear != "4w":
        problems.append(compose(f"qwen_moe option dense_prefill=dequant needs qlinear=4w (int4 dense weights), "
                                f"not qlinear={options.qlinear}"))
    max_seq_len = options.max_seq_len
    if options.checkpoint:
        fields, found = checkpoint_fields.check_checkpoint(options.checkpoint, layers)
        problems += found
        source, depth = "the checkpoint", fields.get("num_hidden_layers")
        limit = fields.get("max_position_embeddings")
        if limit and max_seq_len > limit:
            problems.append(compose(f"qwen_moe option max_seq_len={max_seq_len}",
                                    f"the checkpoint's max_position_embeddings is {limit}"))
        max_seq_len = max_seq_len or min(limit or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)
    elif not options.prequantized:
        source, depth = f"the size {options.size}", sizes.depth(options.size)
        max_seq_len = max_seq_len or sizes.SIZES[options.size].get("max_seq_len", 0)
    if depth is not None and layers > depth:
        problems.append(compose(f"qwen_moe option layers={layers}", f"{source} has {depth}"))
    max_seq_len = max_seq_len or DEFAULT_MAX_SEQ_LEN
    if max_seq_len < MIN_SEQ_LEN:
        problems.append(compose(f"qwen_moe option max_seq_len={max_seq_len}",
                                expected=f"an integer >= {MIN_SEQ_LEN} (default 0: from the checkpoint or the size)"))
    if problems:
        raise InvalidConfig(problems)
    if options.chunk is None:  # the cuda form: no plain delta rule
        return options.replace(max_seq_len=max_seq_len)
    chunk = options.chunk or (CHECKPOINT_CHUNK if options.checkpoint else CHUNKS[options.size])
    return options.replace(max_seq_len=max_seq_len, chunk=min(chunk, max_seq_len))


def _folder(path: str) -> Path:
    return Path(path).expanduser().resolve()


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

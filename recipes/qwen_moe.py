"""qwen_moe: a Qwen3.5-MoE-style hybrid decoder (gated delta rule + GQA, 256-expert MoE) in plain PyTorch.

    doit export model=qwen_moe                                         # size=tiny, random weights
    doit export model=qwen_moe size=35b-a3b layers=4 target=cuda       # real shapes, first 4 layers
    doit export model=qwen_moe size=35b-a3b checkpoint=/models/Qwen3.5-35B-A3B target=cuda

Options: `size` picks a row of cudabuild/models/qwen_moe.py's SIZES (tiny: fp32, 35b-a3b: bf16,
random weights from seed 0); `layers` > 0 keeps only the first layers; `checkpoint` loads a Hugging
Face directory instead (its config.json sets the shapes and dtype, `size` still sets max_seq_len and
the delta-rule chunk). Two methods share `forward(tokens, input_pos) -> last-token logits [1, V]`:
`decode` (one token) and `prefill` (T tokens, T symbolic in [2, max_seq_len - 1]: one graph).
"""

from __future__ import annotations

import json

import torch

from cudabuild.errors import InvalidOption
from cudabuild.models import qwen_moe
from cudabuild.recipe import Method, Recipe


def build(options) -> qwen_moe.Transformer:
    size = options["size"]
    if size not in qwen_moe.SIZES:
        raise InvalidOption(f"qwen_moe: unknown size '{size}'; known sizes: {', '.join(qwen_moe.SIZES)}")
    sized = qwen_moe.SIZES[size]
    if options["checkpoint"]:
        return qwen_moe.from_checkpoint(
            options["checkpoint"], max_seq_len=sized.max_seq_len, chunk=sized.chunk, n_layers=options["layers"]
        )
    return qwen_moe.build(sized.with_layers(options["layers"]), qwen_moe.DTYPES[size], seed=0)


def decode_inputs(model):
    return (torch.tensor([[1]], dtype=torch.long), torch.tensor([0], dtype=torch.long))


def prefill_inputs(model):
    # The longest prompt: AOTInductor sizes its hints (and ExecuTorch its buffers) from the example.
    T = model.args.max_seq_len - 1
    return (torch.arange(T, dtype=torch.long)[None, :] % model.args.vocab_size, torch.arange(T, dtype=torch.long))


def prefill_shapes(model):
    T = torch.export.Dim("T", min=2, max=model.args.max_seq_len - 1)
    return ({1: T}, {0: T})


def metadata(model):
    args = model.args
    return {
        "get_max_seq_len": args.max_seq_len,
        "get_vocab_size": args.vocab_size,
        "get_n_layers": args.n_layers,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,
        # ExecuTorch's qwen3_5_moe runner contract: the per-session state a runner resets.
        "get_mutable_buffer_metadata": json.dumps({"version": 1, "mutable_buffers": model.state_buffer_names()}),
    }


RECIPE = Recipe(
    build=build,
    methods=(
        Method("decode", inputs=decode_inputs),
        Method("prefill", inputs=prefill_inputs, dynamic_shapes=prefill_shapes),
    ),
    options={"size": "tiny", "layers": 0, "checkpoint": ""},
    specs={
        "cpu": {"triton_kernel_mode": "OFF", "max_autotune": "OFF"},
        "cuda": {"triton_kernel_mode": "OFF", "low_memory_mode": "ON"},
    },
    constant_methods=metadata,
)

"""qwen_moe: Qwen3.5-MoE (gated delta rule + GQA, 256-expert MoE), in two forms of one model.

    doit export model=qwen_moe                                         # size=tiny, random weights
    doit export model=qwen_moe size=35b-a3b layers=4 target=cuda       # real shapes, first 4 layers
    doit export model=qwen_moe checkpoint=/models/Qwen3.5-35B-A3B target=cuda
    doit export model=qwen_moe prequantized=/models/qwen35_moe_quantized target=cuda

On cuda the model is ExecuTorch's own Qwen3.5-MoE (cudabuild/models/qwen35_moe.py): quantized
once by the quantize stage (int4 experts for ExecuTorch's fused MoE kernel, torchao int4 linears),
on ExecuTorch's Triton kernels, exported as its exporter does (`decode` and `prefill`, each
`(tokens, input_pos, temperature) -> sampled token [1, 1]`), the artifact its runner runs.
Options there, with the stock exporter's defaults: `size` (tiny = its --tiny-test config, seeded;
35b-a3b), `layers`, `seed`, `checkpoint`, `prequantized` (a bundle of its quantize_and_save.py),
`max_seq_len`, `qlinear` (4w, 8w, 8da4w), `qlinear_group_size`, `qembedding` (8w), `hqq`,
`dense_prefill` (tinygemm, dequant), `moe_activation_dtype` (bf16, int8), `splitk`.

On the CPU, where ExecuTorch's Triton kernels cannot run, it is the same architecture in plain
PyTorch (cudabuild/models/qwen_moe.py), with the options below. The two are one model: both read
a Hugging Face Qwen3.5-MoE checkpoint by its own names (checked against transformers for the CPU
form, tests/test_qwen_moe_hf.py), and tests/test_qwen35_moe.py loads one checkpoint into both
and checks that the CPU form computes the CUDA form's logits (GPU: tests/gpu).

Options: `size` picks a row of cudabuild/models/qwen_moe.py's SIZES (tiny: fp32, 35b-a3b: bf16,
random weights from `seed`, default 0: another seed is new weights for the same code, which
compiles nothing); `layers` > 0 keeps only the first layers; `checkpoint` loads a Hugging
Face directory instead (its config.json sets the shapes and dtype). `max_seq_len` (the KV cache's
length, and the longest prefill + 1) and `chunk` (the delta rule's prefill chunk) left at 0 come
from the checkpoint (its max_position_embeddings, capped at MAX_SEQ_LEN_CAP; chunk CHECKPOINT_CHUNK)
or else from the size; the values used are in the build's options (manifest.json). Two methods
share `forward(tokens, input_pos) -> last-token logits [1, V]`: `decode` (one token) and `prefill`
(T tokens, T symbolic in [2, max_seq_len - 1]: one graph).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cudabuild.errors import InvalidOption
from cudabuild.models import checkpoint, qwen35_moe, qwen35_moe_quantize, qwen_moe, qwen_moe_hf
from cudabuild.recipe import Lowering, Method, Quantize, Recipe, Sampler

# A checkpoint's own context (262144 for Qwen3.5) would size a KV cache and a prefill graph far
# beyond what a build needs; ask for more with max_seq_len=N.
MAX_SEQ_LEN_CAP = 4096
# The delta rule's chunk for real checkpoints: the one of the 35b-a3b size (and of FLA's kernels).
CHECKPOINT_CHUNK = 64
# prefill's T ranges over [2, max_seq_len - 1], which torch.export needs non-empty and not one value.
MIN_SEQ_LEN = 4


def resolve(options) -> dict:
    """The options with max_seq_len and chunk filled in; a checkpoint's config.json is checked here,
    before anything runs (every field that changes the numbers is read or refused)."""
    out = dict(options)
    size = qwen_moe.SIZES.get(options["size"])
    if size is None:  # validated up front by the recipe's choices; also when build() is called directly
        raise InvalidOption(f"qwen_moe: unknown size '{options['size']}'; known sizes: {', '.join(qwen_moe.SIZES)}")
    max_seq_len, chunk = options.get("max_seq_len") or 0, options.get("chunk") or 0
    if options["checkpoint"]:
        path = options["checkpoint"]
        config = checkpoint.read_config(path)
        limit = qwen_moe_hf.max_positions(config)
        qwen_moe_hf.args_from_hf(config, max_seq_len=max_seq_len or MIN_SEQ_LEN, chunk=1, where=f"{path}/config.json")
        if limit and max_seq_len > limit:
            raise InvalidOption(f"qwen_moe option max_seq_len={max_seq_len}: the checkpoint's max_position_embeddings is {limit}")
        max_seq_len = max_seq_len or min(limit or MAX_SEQ_LEN_CAP, MAX_SEQ_LEN_CAP)
        chunk = chunk or CHECKPOINT_CHUNK
    max_seq_len, chunk = max_seq_len or size.max_seq_len, chunk or size.chunk
    if max_seq_len < MIN_SEQ_LEN:
        raise InvalidOption(f"qwen_moe option max_seq_len={max_seq_len}: expected an integer >= {MIN_SEQ_LEN} "
                            "(default 0: from the checkpoint or the size)")
    if chunk < 1:
        raise InvalidOption(f"qwen_moe option chunk={chunk}: expected an integer >= 1 (default 0: from the checkpoint or the size)")
    out.update(max_seq_len=max_seq_len, chunk=min(chunk, max_seq_len))
    return out


def build(options) -> qwen_moe.Transformer:
    options = resolve(options)
    if options["checkpoint"]:
        return qwen_moe_hf.from_checkpoint(
            options["checkpoint"], max_seq_len=options["max_seq_len"], chunk=options["chunk"], n_layers=options["layers"]
        )
    sized = replace(qwen_moe.SIZES[options["size"]], max_seq_len=options["max_seq_len"], chunk=options["chunk"])
    return qwen_moe.build(sized.with_layers(options["layers"]), seed=options["seed"])


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
    return qwen35_moe.runner_metadata(args.max_seq_len, args.vocab_size, args.n_layers, model.state_buffer_names())


# ExecuTorch's Qwen3.5-MoE on its CUDA backend, as its export.py builds it.
CUDA = Recipe(
    build=None,
    quantize=Quantize(run=qwen35_moe_quantize.quantize, load=qwen35_moe.load,
                      options=qwen35_moe.QUANTIZE_OPTIONS, folders=qwen35_moe.QUANTIZE_FOLDERS),
    methods=(
        Method("decode", inputs=qwen35_moe.decode_inputs, prepare=qwen35_moe.prepare_decode,
               verify_steps=qwen35_moe.decode_steps, sampler=Sampler(temperature_input=2)),
        Method("prefill", inputs=qwen35_moe.prefill_inputs, dynamic_shapes=qwen35_moe.prefill_shapes,
               prepare=qwen35_moe.prepare_prefill, verify_steps=qwen35_moe.prefill_steps,
               sampler=Sampler(temperature_input=2)),
    ),
    options=qwen35_moe.OPTIONS,
    choices=qwen35_moe.CHOICES,
    resolve=qwen35_moe.resolve,
    specs={
        # The stock exporter's: its int4 and Triton ops leave no ATen GEMM, so no autotuning; the
        # C++ wrapper at -O0 (it only launches kernels); no coordinate-descent tuning.
        "cuda": {"emulate_precision_casts": "OFF", "max_autotune": "OFF", "autotune_at_compile_time": "OFF",
                 "autotune_pointwise": "OFF", "compile_wrapper_opt_level": "O0", "coordinate_descent_tuning": "OFF"},
    },
    constant_methods=qwen35_moe.metadata,
    strict_export=True,
    weights_options=("seed",),
    lowering=Lowering(skip_dim_order=True, do_quant_fusion_and_const_prop=True, alloc_graph_input=False,
                      emit_mutable_buffer_names=True),
)

RECIPE = Recipe(
    build=build,
    methods=(
        Method("decode", inputs=decode_inputs),
        Method("prefill", inputs=prefill_inputs, dynamic_shapes=prefill_shapes),
    ),
    options={"size": "tiny", "layers": 0, "seed": 0, "checkpoint": "", "max_seq_len": 0, "chunk": 0},
    choices={"size": tuple(qwen_moe.SIZES)},
    resolve=resolve,
    specs={"cpu": {"triton_kernel_mode": "OFF", "max_autotune": "OFF"}},
    constant_methods=metadata,
    targets={"cuda": CUDA},
    weights_options=("seed",),
)

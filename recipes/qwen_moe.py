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

Options (one table, OPTIONS, for both forms: each option's type, range or choices and the targets
it applies to): `size` picks a row of cudabuild/models/qwen_moe.py's SIZES (tiny: fp32, 35b-a3b:
bf16, random weights from `seed`: another seed is new weights for the same code, which
compiles nothing); `layers` > 0 keeps only the first layers (0: every layer);
`checkpoint` loads a Hugging Face directory instead (its config.json sets the shapes and dtype;
it and the tensors it implies are checked before any stage runs). `max_seq_len` (the KV cache's
length, and the longest prefill + 1) and `chunk` (the delta rule's prefill chunk) left at 0 come
from the checkpoint (its max_position_embeddings, capped at MAX_SEQ_LEN_CAP; chunk CHECKPOINT_CHUNK)
or else from the size; the values used are in the build's options (manifest.json). Two methods
share `forward(tokens, input_pos) -> last-token logits [1, V]`: `decode` (one token) and `prefill`
(T tokens, T symbolic in [2, max_seq_len - 1]: one graph).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cudabuild.errors import InvalidConfig, InvalidOption
from cudabuild.models import qwen35_moe, qwen35_moe_fp32, qwen35_moe_quantize, qwen_moe, qwen_moe_checkpoint, qwen_moe_hf
from cudabuild.options import Option
from cudabuild.recipe import Lowering, Method, Quantize, Recipe, Sampler

# A checkpoint's own context (262144 for Qwen3.5) would size a KV cache and a prefill graph far
# beyond what a build needs; ask for more with max_seq_len=N.
MAX_SEQ_LEN_CAP = 4096
# The delta rule's chunk for real checkpoints: the one of the 35b-a3b size (and of FLA's kernels).
CHECKPOINT_CHUNK = 64
# prefill's T ranges over [2, max_seq_len - 1], which torch.export needs non-empty and not one value.
MIN_SEQ_LEN = 4
# The longest context asked for: Qwen3.5's own (its max_position_embeddings).
MAX_SEQ_LEN = 262_144

CPU, CUDA = ("cpu",), ("cuda",)
# Every option of both forms, once: its type (its default's), range or choices, and the targets it
# applies to (none named: both). A value for an option of the other form is refused up front.
OPTIONS = (
    Option("size", "tiny", choices=tuple(qwen_moe.SIZES), help="a named size (random weights)"),
    Option("layers", 0, minimum=0, meaning={0: "every layer"}, help="keep only the first layers"),
    Option("checkpoint", "", folder=True, help="a Hugging Face checkpoint folder"),
    Option("prequantized", "", folder=True, targets=CUDA, help="a bundle of ExecuTorch's quantize_and_save.py"),
    Option("seed", 42, minimum=0, help="the random weights' seed (the stock --tiny-test's; another is new weights for the same code)"),
    Option("max_seq_len", 0, minimum=0, maximum=MAX_SEQ_LEN, meaning={0: "from the checkpoint or the size"},
           help=f"the KV cache's length (and the longest prefill + 1): 0, or {MIN_SEQ_LEN} and more"),
    Option("chunk", 0, minimum=0, targets=CPU, meaning={0: "from the checkpoint or the size"},
           help="the delta rule's prefill chunk"),
    Option("qlinear", "4w", choices=("4w", "8w", "8da4w"), targets=CUDA),
    Option("qlinear_group_size", 32, minimum=1, targets=CUDA),
    Option("qembedding", "", choices=("", "8w"), targets=CUDA),
    Option("hqq", False, targets=CUDA),
    Option("dense_prefill", "tinygemm", choices=("tinygemm", "dequant"), targets=CUDA),
    Option("moe_activation_dtype", "bf16", choices=("bf16", "int8"), targets=CUDA),
    Option("splitk", True, targets=CUDA),
)
assert tuple(qwen_moe.SIZES) == tuple(qwen35_moe_quantize.SIZES)  # one size option for both forms
CUDA_DEFAULTS = {o.name: o.default for o in OPTIONS if o.applies_to("cuda")}


def resolve(options) -> dict:
    """The options with max_seq_len and chunk filled in, every problem collected: a checkpoint's
    config.json and its tensors' headers are checked here (cudabuild/models/qwen_moe_checkpoint.py),
    before anything runs."""
    out = dict(options)
    size = qwen_moe.SIZES.get(options["size"])
    if size is None:  # validated up front by the option's choices; also when build() is called directly
        raise InvalidOption(f"qwen_moe: unknown size '{options['size']}'; known sizes: {', '.join(qwen_moe.SIZES)}")
    problems = []
    layers = int(options.get("layers") or 0)
    max_seq_len, chunk = options.get("max_seq_len") or 0, options.get("chunk") or 0
    if options.get("checkpoint"):
        fields, found = qwen_moe_checkpoint.check_checkpoint(options["checkpoint"], "cpu", layers)
        problems += found
        limit = fields.get("max_position_embeddings")
        if limit and max_seq_len > limit:
            problems.append(f"qwen_moe option max_seq_len={max_seq_len}: the checkpoint's max_position_embeddings is {limit}")
        max_seq_len = max_seq_len or min(limit or MAX_SEQ_LEN_CAP, MAX_SEQ_LEN_CAP)
        chunk = chunk or CHECKPOINT_CHUNK
    elif layers > size.n_layers:
        problems.append(f"qwen_moe option layers={layers}: the size {options['size']} has {size.n_layers}")
    max_seq_len, chunk = max_seq_len or size.max_seq_len, chunk or size.chunk
    if max_seq_len < MIN_SEQ_LEN:
        problems.append(f"qwen_moe option max_seq_len={max_seq_len}: expected an integer >= {MIN_SEQ_LEN} "
                        "(default 0: from the checkpoint or the size)")
    if problems:
        raise InvalidConfig(problems)
    out.update(max_seq_len=max_seq_len, chunk=min(chunk, max_seq_len))
    return out


def resolve_cuda(options) -> dict:
    return qwen35_moe.resolve(options, CUDA_DEFAULTS)


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
    quantize=Quantize(run=qwen35_moe_quantize.quantize, load=qwen35_moe.load, truth=qwen35_moe_fp32.truth,
                      options=qwen35_moe.QUANTIZE_OPTIONS, folders=qwen35_moe.QUANTIZE_FOLDERS),
    methods=(
        Method("decode", inputs=qwen35_moe.decode_inputs, prepare=qwen35_moe.prepare_decode,
               verify_steps=qwen35_moe.decode_steps, sampler=Sampler(temperature_input=2)),
        Method("prefill", inputs=qwen35_moe.prefill_inputs, dynamic_shapes=qwen35_moe.prefill_shapes,
               prepare=qwen35_moe.prepare_prefill, verify_steps=qwen35_moe.prefill_steps,
               sampler=Sampler(temperature_input=2)),
    ),
    options=OPTIONS,
    resolve=resolve_cuda,
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
    options=OPTIONS,
    resolve=resolve,
    specs={"cpu": {"triton_kernel_mode": "OFF", "max_autotune": "OFF"}},
    constant_methods=metadata,
    targets={"cuda": CUDA},
    weights_options=("seed",),
)

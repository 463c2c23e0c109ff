"""qwen_moe: ExecuTorch's Qwen3.5-MoE (gated delta rule + GQA, 256-expert MoE), one model in two forms.

    doit export model=qwen_moe                                         # size=tiny, random weights
    doit export model=qwen_moe size=35b-a3b layers=4 target=cuda       # real shapes, first 4 layers
    doit export model=qwen_moe checkpoint=/models/Qwen3.5-35B-A3B target=cuda
    doit export model=qwen_moe checkpoint=Qwen/Qwen3.5-35B-A3B target=cuda   # a Hub id: its cached snapshot
    doit export model=qwen_moe prequantized=/models/qwen35_moe_quantized target=cuda

The model is ExecuTorch's (executorch.examples.models.qwen3_5_moe.model.Qwen35MoE) on every target.
On cuda (cudabuild/models/qwen35_moe_cuda.py) it is quantized once by the quantize stage (int4 experts
for ExecuTorch's fused MoE kernel, torchao int4 linears), runs on ExecuTorch's Triton kernels and
is exported as its exporter does (`decode` and `prefill`, each `(tokens, input_pos, temperature)
-> sampled token [1, 1]`), the artifact its runner runs. Elsewhere (the CPU), the modules that call
Triton kernels are swapped for plain PyTorch by a source transformation that keeps their names and
weights (cudabuild/models/qwen35_moe_plain.py), the weights stay unquantized (fp32 for tiny, bf16
for 35b-a3b, a checkpoint's own dtype), and both methods are `(tokens, input_pos) -> the last
token's logits [1, V]`, the forward ExecuTorch binds for backends that sample on the host.

Both forms take their weights from one place (the size's seeded draw of the stock --tiny-test, or a
Hugging Face checkpoint through ExecuTorch's lazy subset reader: cudabuild/models/
qwen35_moe_weights.py `weight_parts`) and check a checkpoint against one table of config.json's
fields before any stage (cudabuild/models/qwen_moe_checkpoint.py). tests/test_qwen_moe.py checks on
the CPU that the transformed model computes what ExecuTorch's model computes with its Triton ops
answered in fp32; tests/gpu/test_qwen_moe_cuda.py compares it with ExecuTorch's Triton kernels.

Options: one table for both forms (each option's type, range or choices, default, the targets it
applies to, and what the build does with it; one of the other form is refused up front): the
models read them as attributes of one typed object (cudabuild.options.Options), and one `resolve`
(cudabuild/models/qwen35_moe.py) fills in `max_seq_len` (and `chunk` on the CPU) and collects
every problem.
"""

from __future__ import annotations

from cudabuild.models import (qwen35_moe, qwen35_moe_cuda, qwen35_moe_fp32, qwen35_moe_plain, qwen35_moe_quantize,
                              qwen35_moe_sizes)
from cudabuild.options import Option
from cudabuild.recipe import Lowering, Method, Quantize, Recipe, Sampler

# The targets an option applies to (`targets=`): names, never the forms below.
CPU_ONLY, CUDA_ONLY = ("cpu",), ("cuda",)
# Every option of both forms, once: its type (its default's), range or choices, the targets it
# applies to (none named: both), and what the build does with it: what decides the quantized weights
# (`quantize`: the quantize stage's key), what changes the weights' values alone (`values_only`),
# the checkpoint the weights are read from, and what a prequantized bundle decides by itself
# (`decided_by`). A value for an option of the other form is refused up front.
OPTIONS = (
    Option("size", "tiny", choices=tuple(qwen35_moe_sizes.SIZES), quantize=True,
           help="a named size: tiny (the stock --tiny-test config) or 35b-a3b; random weights"),
    Option("layers", 0, minimum=0, meaning={0: "every layer"}, quantize=True, decided_by="prequantized",
           help="keep only the first layers"),
    Option("checkpoint", "", folder=True, hub=True, quantize=True, checkpoint=True,
           help="a Hugging Face checkpoint folder, or its Hub id (ORG/NAME[@REVISION]) in the Hub's cache"),
    Option("prequantized", "", folder=True, targets=CUDA_ONLY, quantize=True,
           help="a bundle of ExecuTorch's quantize_and_save.py"),
    Option("seed", 42, minimum=0, quantize=True, values_only=True,
           help="the random weights' seed (the stock --tiny-test's; another is new weights for the same code)"),
    Option("max_seq_len", 0, minimum=0, maximum=262_144, meaning={0: "from the checkpoint or the size"},
           help=f"the KV cache's length (and the longest prefill + 1): 0, or {qwen35_moe.MIN_SEQ_LEN} and more"),
    Option("chunk", 0, minimum=0, targets=CPU_ONLY, meaning={0: "from the checkpoint or the size"},
           help="the plain delta rule's prefill chunk"),
    Option("qlinear", "4w", choices=("4w", "8w", "8da4w"), targets=CUDA_ONLY, quantize=True, decided_by="prequantized"),
    Option("qlinear_group_size", 32, minimum=1, targets=CUDA_ONLY, quantize=True, decided_by="prequantized"),
    Option("qembedding", "", choices=("", "8w"), targets=CUDA_ONLY, quantize=True, decided_by="prequantized"),
    Option("hqq", False, targets=CUDA_ONLY, quantize=True, decided_by="prequantized"),
    Option("dense_prefill", "tinygemm", choices=("tinygemm", "dequant"), targets=CUDA_ONLY),
    Option("moe_activation_dtype", "bf16", choices=("bf16", "int8"), targets=CUDA_ONLY),
    Option("splitk", True, targets=CUDA_ONLY),
)


# ExecuTorch's Qwen3.5-MoE on its CUDA backend, as its export.py builds it.
CUDA_FORM = Recipe(
    build=None,
    quantize=Quantize(run=qwen35_moe_quantize.quantize, load=qwen35_moe_cuda.load, truth=qwen35_moe_fp32.truth),
    methods=(
        Method("decode", inputs=qwen35_moe_cuda.decode_inputs, prepare=qwen35_moe_cuda.prepare_decode,
               verify_steps=qwen35_moe_cuda.decode_steps, sampler=Sampler(temperature_input=2)),
        Method("prefill", inputs=qwen35_moe_cuda.prefill_inputs, dynamic_shapes=qwen35_moe_cuda.prefill_shapes,
               prepare=qwen35_moe_cuda.prepare_prefill, verify_steps=qwen35_moe_cuda.prefill_steps,
               sampler=Sampler(temperature_input=2)),
    ),
    options=OPTIONS,
    resolve=qwen35_moe.resolve,
    specs={
        # The stock exporter's: its int4 and Triton ops leave no ATen GEMM, so no autotuning; the
        # C++ wrapper at -O0 (it only launches kernels); no coordinate-descent tuning. But Triton's
        # tuning at compile time, on example values (torch's AOTInductor default, and ExecuTorch's
        # since pytorch/executorch#22758), where the stock 1.4.1 exporter runs the whole program on
        # its real weights: so the compile never runs the program, and its weights stay on the host
        # (cudabuild.backend.lowmem), which keeps a 40-layer compile within a 24 GB card.
        "cuda": {"emulate_precision_casts": "OFF", "max_autotune": "OFF", "autotune_at_compile_time": "ON",
                 "autotune_pointwise": "OFF", "compile_wrapper_opt_level": "O0", "coordinate_descent_tuning": "OFF"},
    },
    constant_methods=qwen35_moe.metadata,
    strict_export=True,
    weights_bytes=qwen35_moe_cuda.weights_bytes,
    lowering=Lowering(skip_dim_order=True, do_quant_fusion_and_const_prop=True, alloc_graph_input=False,
                      emit_mutable_buffer_names=True),
)

RECIPE = Recipe(
    build=qwen35_moe_plain.build,
    methods=(
        Method("decode", inputs=qwen35_moe_plain.decode_inputs),
        Method("prefill", inputs=qwen35_moe_plain.prefill_inputs, dynamic_shapes=qwen35_moe_plain.prefill_shapes),
    ),
    options=OPTIONS,
    resolve=qwen35_moe.resolve,
    specs={"cpu": {"triton_kernel_mode": "OFF", "max_autotune": "OFF"}},
    constant_methods=qwen35_moe.metadata,
    targets={"cuda": CUDA_FORM},
    weights_bytes=qwen35_moe_plain.weights_bytes,
)

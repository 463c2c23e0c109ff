"""What a recipe declares: a model factory, its methods and their compile specs, as plain data.

Owns the shape of that declaration (Recipe, Method, Quantize, Sampler, Lowering). Must not touch
torch, the registry or a build; an option's table and typed values are cudabuild/options.py's.

A recipe file (`recipes/<name>.py`) defines one module-level `RECIPE = Recipe(...)`. It parses no
command line and does no I/O at import time; everything that needs torch happens inside the
callables it hands over, which the stages call. This module must not import torch.

A model whose form differs per target (ExecuTorch's Qwen3.5-MoE on cuda, the same model without
its Triton kernels on the CPU) declares the other form under `targets`: each form is a whole Recipe of its own
(model, methods, options, specs), and the build takes the one for its target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from cudabuild.options import Options, table, typed_defaults

# Spec values are per target: {"cpu": {...}, "cuda": {...}}; "all" applies to every target.
TargetSpecs = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True)
class Sampler:
    """A method that samples its output token from logits inside the program (ExecuTorch's CUDA
    Qwen3.5-MoE draws it with a Gumbel-max sampler at a runtime temperature).

    verify compares logits, not draws: it runs the method at `greedy_temperature` (input number
    `temperature_input`), where the draw is the argmax, and checks that the token the compiled code
    chose has, in the eager program's own logits (the tensor the sampler divides by the
    temperature), a logit within the tolerance of the largest.
    """

    temperature_input: int
    greedy_temperature: float = 1e-6


@dataclass(frozen=True)
class Method:
    """One exported entry point of the model.

    `inputs(model)` returns the example inputs (a tuple of tensors); `dynamic_shapes(model)`, when
    given, returns what torch.export takes for them. Both receive the built model so they can read
    its configuration (max_seq_len and the like). `specs` overrides the recipe's specs for this
    method only, per target.

    `prepare(model, options)`, when given, switches the shared eager model to this method's path
    before it is exported (which MoE kernel, which dense prefill). `verify_steps(model)`, when
    given, is the list of input tuples verify runs one after another on one loaded program (state
    carried between them, as a runner does) instead of the example inputs once.
    """

    name: str
    inputs: Callable[[Any], tuple]
    dynamic_shapes: Optional[Callable[[Any], Any]] = None
    specs: TargetSpecs = field(default_factory=dict)
    prepare: Optional[Callable[[Any, Options], None]] = None
    verify_steps: Optional[Callable[[Any], list]] = None
    sampler: Optional[Sampler] = None


@dataclass(frozen=True)
class Quantize:
    """Weights prepared once, ahead of every method's export: the `quantize` stage.

    `run(options, folder, device)` writes the prepared weights into `folder` (for instance a
    model.safetensors and config.json) and returns {name: path} of what it wrote; `load(options,
    folder)` builds the eager model from such a folder. The stage's key is what decides those
    weights and nothing else: the options the table marks `quantize` (a folder among them, a
    checkpoint or a prequantized bundle, by its content: tensor by tensor), the source of the
    module that defines `run` (and the project modules it imports), and the toolchain. So a change
    of compile specs, of a method, or of an export-only option never runs it again.
    """

    run: Callable[[Options, Any, str], Mapping[str, Any]]
    load: Callable[[Options, Any], Any]
    # The stage runs on the target's device (torchao packs int4 weights for CUDA's kernels there).
    on_device: bool = True
    # An fp32 truth of the quantized model, for verify on a device (the reference stage calls it):
    # `truth(options, folder, prepare, steps, device, eager)` -> {"truth": {"logits", "states"},
    # "envelope": {"states", "gaps", "deviations"}, "runs"}: the method's verify steps in fp32 on the same weights,
    # and the largest distance from them of bf16 runs (`eager`, the eager program's own, among
    # them). Where given, verify asks the compiled program to be about as close to the truth as
    # bf16 is (cudabuild.backend.sampled_logits) instead of close to the bf16 eager run itself.
    truth: Optional[Callable[..., Mapping[str, Any]]] = None


@dataclass(frozen=True)
class Lowering:
    """How ExecuTorch lowers and serializes the methods, where a model's own exporter does it its
    way (keyed: edge's key holds `skip_dim_order`, the package's the rest).

    `skip_dim_order`: EdgeCompileConfig._skip_dim_order. The rest are ExecutorchBackendConfig's
    (to_executorch): delegate segments outside the flatbuffer, quant fusion and constant
    propagation, graph inputs not planned (`alloc_graph_input`), mutable buffers by name.
    """

    skip_dim_order: bool = False
    extract_delegate_segments: bool = True
    do_quant_fusion_and_const_prop: bool = False
    alloc_graph_input: bool = True
    emit_mutable_buffer_names: bool = False

    def as_data(self) -> dict:
        return {"skip_dim_order": self.skip_dim_order, "extract_delegate_segments": self.extract_delegate_segments,
                "do_quant_fusion_and_const_prop": self.do_quant_fusion_and_const_prop,
                "alloc_graph_input": self.alloc_graph_input, "emit_mutable_buffer_names": self.emit_mutable_buffer_names}


@dataclass(frozen=True)
class Recipe:
    """A model and how to lower it.

    `build(options)` returns the eager `torch.nn.Module`; it is handed the recipe's options for the
    build's target, typed (cudabuild.options.Options: `options.layers`): the defaults merged with
    command-line values (`size=35b-a3b layers=4 checkpoint=DIR`), each checked against the recipe's
    option table (type, range, choices, the targets it applies to), then passed through `resolve`
    when given.
    `constant_methods(model)` returns the metadata methods written into the .pte (ints, floats,
    strings, lists of them). With `quantize`, the model comes from the quantize stage's output
    (`quantize.load`) instead of `build`.
    """

    build: Optional[Callable[[Options], Any]]
    methods: tuple[Method, ...]
    # The option table: cudabuild.options.Option rows (each with its type, range or choices, the
    # targets it applies to, and what the build does with it), one table for every form of the
    # model; or a plain {name: default} for options of any value of their default's type.
    options: Any = field(default_factory=dict)
    # `resolve(options)` fills in options whose value follows from others (a length read from the
    # checkpoint's config.json) and refuses what cannot be built, before any stage runs, raising
    # InvalidConfig with every problem; what it returns (`options.replace(...)`) is what the keys
    # and the manifest hold. It may read what the folders its options name hold, but of a
    # .safetensors file only its header (cudabuild.registry keys its memo by those).
    resolve: Optional[Callable[[Options], Mapping[str, Any]]] = None
    specs: TargetSpecs = field(default_factory=dict)
    constant_methods: Optional[Callable[[Any], Mapping[str, Any]]] = None
    # Per-dtype verify tolerance overrides, e.g. {"float32": 1e-4}.
    tolerances: Mapping[str, float] = field(default_factory=dict)
    quantize: Optional[Quantize] = None
    # torch.export's strict mode (TorchDynamo), as the model's own exporter uses it.
    strict_export: bool = False
    lowering: Optional[Lowering] = None
    # The form of this model for other targets: {"cuda": Recipe(...)}.
    targets: Mapping[str, "Recipe"] = field(default_factory=dict)
    # `weights_bytes(resolved options)`: about how many bytes its weights take as the build keeps
    # them (a quantized bundle), from the options alone, before any stage: what the build's disk
    # need is projected from (cudabuild.engine.room). None: not projected.
    weights_bytes: Optional[Callable[[Options], int]] = None

    def for_target(self, target: str) -> "Recipe":
        return self.targets.get(target, self)

    def defaults(self, target: str = "cpu") -> Options:
        """The options that apply to `target` at their defaults, typed (what `build` gets, before
        `resolve`, when the command line sets none)."""
        return typed_defaults(table(self.options), target)

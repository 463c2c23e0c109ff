"""The CUDA lowering pipeline as data: the table of stage kinds the engine builds.

    probe ─┬─> [quantize] ─┬─(layout)─> trace[m] ─(code)─┐
           │               └─────────(weights)───────────┴─> export[m] ─┬─(code)─> edge[m] ─> compile[m] ─┐
           │                                                            ├──────(weights)──────────────> blob[m] ─┬─> package ──> (outputs in build/<model>/<target>/)
           │                                                            │                                        └─> verify[m]
           │                                                            └─> [reference[m]] ──────────────────────────────┘
           └─────────────────────────────────────────(toolchain)──────────────────────────────────────────┘

Nothing after the trace follows the weights' values where it need not. `trace` (torch.export of
the recipe's model) is keyed on the code and the weights' layout: the options but those its table
marks `values_only` (a seed: the description's `weights_options`), and the quantize stage's
`layout` facet, not its digest. `export` gives the program for this build's weights: the
trace's, handed on where it was traced from this very model, else the trace's with the new model's
weights bound into it by FQN, without torch.export (cudabuild.backend.stages.export, which checks
that they fit and traces where they do not). Edge and compile follow the exported program's *code* (its graph and its tensors' names,
dtypes, shapes and strides: export's `code` facet), not its weights' values, so new weights for
the same model trace, lower and compile nothing; `blob` follows the weights, and writes their
weights blob for the compiled code (cudabuild.backend.stages.blob). The `weights_options` are
the options explain knows to change the weights alone (`values_only`).

`quantize` is in a build only when the recipe's form for the target declares one (ExecuTorch's
Qwen3.5-MoE on cuda): the weights are prepared once, for both methods' exports. `reference` (the
method's eager results, which verify compares with) is a stage of its own on a device target,
where it is costly and would otherwise wait for the compile it does not depend on.

The two methods' chains run side by side under `doit -n N` (the default: one per core); a row's
`runs_alone` says when a stage must have the machine to itself, and `device` which accelerator it
must have to itself (cudabuild.engine.workers).

Each row says whether the stage runs per method, what it consumes, which of its key inputs are
upstream digests, what else enters its key (`params`), and its version (bump it when the stage's
implementation changes what it produces). The stage's code is the module the row names, with
`run(ctx) -> StageResult`. This module joins the engine (cudabuild.engine.graph) and the backend
(cudabuild.backend): it imports neither torch nor executorch.
"""

from __future__ import annotations

from cudabuild.backend import toolchain
from cudabuild.backend.tuning import pinned_digest
from cudabuild.engine.graph import KeyContext, Pipeline, Stage, StageKind
from cudabuild.formats import safetensors_parts
from cudabuild.specs import compile_keeps_weights_on_host, specs_for_stage, times_kernels

STAGES = "cudabuild.backend.stages."


def _toolchain(ctx: KeyContext, *fields: str) -> dict:
    """The toolchain probe reported (the fields a stage depends on, or all of them)."""
    probe = ctx.read(Stage("probe"))
    value = (probe.value if probe else None) or {}
    return {f: value.get(f) for f in fields} if fields else value


def _probe(ctx: KeyContext) -> dict:
    return {"fingerprint": ctx.fingerprint()}


def _quantize(ctx: KeyContext) -> dict:
    """What decides the prepared weights: the quantization options, the weights' content (the
    checkpoint's or bundle's tensors; a seeded model's options are among the options), the code
    that prepares them, and the toolchain. Nothing about methods, export or compile."""
    config = ctx.config
    declared = config.description["quantize"]
    sources = config.description["sources"]
    folders = {name: ctx.checkpoint_digest(config.options[name]) if config.options.get(name) else None
               for name in declared["folders"]}
    return {
        "model": config.model,
        "options": {name: config.options[name] for name in declared["options"]},
        **folders,
        "sources": {path: sources[path] for path in declared["sources"]},
        "toolchain": _toolchain(ctx, "torch", "executorch", "torchao"),
    }


def _quantizes(config) -> bool:
    return bool(config.description.get("quantize"))


def _quantize_device(config, method) -> str | None:
    declared = config.description.get("quantize") or {}
    return config.target if declared.get("on_device") and config.target != "cpu" else None


def _weights_options(config) -> set[tuple[str, ...]]:
    """The options that change nothing but the weights' values (the recipe's `weights_options`)."""
    return {("options", name) for name in config.description.get("weights_options") or ()}


def _keyed_options(config) -> dict:
    """The options as a key holds them. A folder's enters by its content (the checkpoint's digest
    below; a bundle's through quantize's result), not by the name it was given: a path, or a Hub
    id and the snapshot it resolves to (cudabuild.hub), key one build alike."""
    folders = {o["name"] for o in config.description.get("option_table", ()) if o.get("folder")}
    return {name: FOLDER_BY_CONTENT if name in folders and value else value for name, value in config.options.items()}


# What a folder option that is set holds in a key, in place of its path.
FOLDER_BY_CONTENT = "(keyed by its content)"


def _export(ctx: KeyContext) -> dict:
    """What decides the eager model, its weights' values included (export binds them)."""
    config = ctx.config
    return {
        "model": config.model,
        "sources": dict(config.description["sources"]),
        "options": _keyed_options(config),
        "checkpoint": ctx.checkpoint_digest(),
        "toolchain": _toolchain(ctx, "torch"),
        **({"strict": True} if config.description.get("strict_export") else {}),
    }


def _trace(ctx: KeyContext) -> dict:
    """Export's, less what decides only the weights' values: the options the recipe declares so (a
    seed), the checkpoint's tensors' bytes (its layout stays: each tensor's dtype and shape, the
    other files' content) and where the folders whose layout is keyed lie (the checkpoint, and a
    bundle the quantize stage reads, whose `layout` facet is the row's results): what decides the
    traced program. A nightly's next checkpoint in a new folder, of the same layout, traces nothing."""
    description = ctx.config.description
    inputs = _export(ctx)
    checkpoint = {o["name"] for o in description.get("option_table", ()) if o.get("checkpoint")}
    left_out = {*(description.get("weights_options") or ()), *checkpoint,
                *((description.get("quantize") or {}).get("folders") or ())}
    inputs["options"] = {name: value for name, value in inputs["options"].items() if name not in left_out}
    if ctx.config.checkpoint:
        inputs["checkpoint"] = ctx.checkpoint_digest(layout=True)
    return inputs


def _lowering(config, *fields: str) -> dict:
    """The recipe's own lowering settings (cudabuild.recipe.Lowering) that the stage reads; none
    when the recipe keeps ExecuTorch's defaults, so such a recipe's keys are what they always were."""
    lowering = config.description.get("lowering")
    return {"lowering": {f: lowering[f] for f in fields}} if lowering else {}


def _edge(ctx: KeyContext) -> dict:
    return {"specs": specs_for_stage(ctx.config.specs[ctx.method], "edge"),
            "toolchain": _toolchain(ctx, "torch", "executorch", "triton"),
            **_lowering(ctx.config, "skip_dim_order")}


def _compile(ctx: KeyContext) -> dict:
    config = ctx.config
    return {
        "specs": specs_for_stage(config.specs[ctx.method], "compile"),
        "toolchain": _toolchain(ctx),
        # Pinned tuning decisions dictate the kernels: a different pin is a different compile.
        "autotune_pin": pinned_digest(config.project, config.model, config.target, ctx.method),
    }


def _blob(ctx: KeyContext) -> dict:
    # Reading tensors from the store and writing their bytes; on a refusal, the compile's own
    # inputs (its key: specs, toolchain) decide what is compiled.
    return {"toolchain": _toolchain(ctx, "torch")}


def _package(ctx: KeyContext) -> dict:
    # Every spec is serialized into the .pte, so all of them key the package.
    return {"methods": {m: {"specs": dict(ctx.config.specs[m])} for m in ctx.config.methods},
            "toolchain": _toolchain(ctx, "torch", "executorch"),
            **_lowering(ctx.config, "extract_delegate_segments", "do_quant_fusion_and_const_prop",
                        "alloc_graph_input", "emit_mutable_buffer_names")}


def _reference(ctx: KeyContext) -> dict:
    # The eager run calls the program's Triton ops (ExecuTorch's, flash-linear-attention's); a
    # recipe's fp32 truth is computed from the quantize stage's weights (an input) by its own code.
    config = ctx.config
    sampler = (config.description.get("samplers") or {}).get(ctx.method)
    truth = (config.description.get("quantize") or {}).get("truth_sources")
    sources = config.description["sources"]
    return {"toolchain": _toolchain(ctx, "torch", "executorch", "triton"), **({"sampler": sampler} if sampler else {}),
            **({"truth": {path: sources.get(path) for path in truth}} if truth else {})}


def _reference_apart(config) -> bool:
    """A device target runs the eager reference as a stage of its own (cudabuild.backend.stages.reference)."""
    return config.target != "cpu"


def _verify(ctx: KeyContext) -> dict:
    sampler = (ctx.config.description.get("samplers") or {}).get(ctx.method)
    return {"tolerances": dict(ctx.config.description.get("tolerances", {})), "toolchain": _toolchain(ctx, "torch"),
            **({"sampler": sampler} if sampler else {})}


# What every stage that runs imports first, imported once by a warm process (cudabuild.engine.warm)
# instead of by each: torch, inductor, torch.export and ExecuTorch's program and lowering code
# (about 6 s of imports on a 2-core machine). Only modules every build of the target imports
# anyway, so a stage in a warm child sees the libraries it would have seen; on a device, Triton
# too, but not ExecuTorch's Triton ops: flash-linear-attention, which they import, may load the
# CUDA driver, and a driver loaded before the fork is unusable in the children.
_WARM_IMPORTS = ("torch", "torch._inductor.compile_fx", "torch._inductor.codecache", "torch.export",
                 "executorch.exir", "executorch.exir.serde.serialize", "executorch.backends.aoti.aoti_partitioner")


def _warm_imports(target: str) -> tuple[str, ...]:
    return _WARM_IMPORTS + (("triton",) if target != "cpu" else ())


def _compile_alone(config, method) -> str | None:
    if config.target == "cpu" and times_kernels(config.specs[method], config.target):
        return "it tunes kernels by timing them on the CPU, which a stage beside it would skew"
    return None


# A device stage's peak in a first build, as a multiple of the weights it is handed. Measured on the
# H100 at 35b-a3b (int4): a compile that moves its weights to the device (low_memory_mode ON,
# autotune_at_compile_time OFF) 0.95x (decode) and 1.12x (prefill) at 8 layers, with it OFF about
# 2.6x at 4 layers; verify holds the compiled weights once (a cudaMalloc of the blob) and the steps'
# activations. A compile that keeps its weights on the host holds Triton's example values for a
# layer's kernels, and the reference streams its weights op by op (cudabuild.backend.streamed_eager)
# and its truth layer by layer: both hold one layer, the embedding and the head at a time, which
# these factors over-estimate at 8 layers and fit at 40 (to be calibrated: issue 57). The blob stage
# uses the device only where it must compile, which a first build does not.
_DEVICE_FACTORS = {"compile": 0.15, "reference": 0.3, "verify": 1.0, "blob": 0.0, "probe": 0.0, "quantize": 0.0}


# A stage's resident peak in a first build, as a multiple of the weights it is handed, measured on
# the H100 at 35b-a3b (int4; 5.14 GB of weights at 8 layers, 20.4 GB at 40): export 2.1x and 1.9x
# (the model built, and its weights mapped), edge 0.35x and 0.18x (it maps them, and touches few),
# compile 3.7x at 8 (AOTInductor's blob in memory, and the mapped weights it copied from, before
# the compile kept that blob out of memory: now it touches no weight, so 0.5x until it is measured
# again), reference 1.87x and 1.85x (the truth's model read into memory, and the program's weights
# mapped: 1.0x of private memory), package 1.09x. Mapped pages count in a process's resident size
# though the page cache holds them once for every process that maps them, which is why a measured
# peak's private part, where it has one, is what the ledger reserves (cudabuild.engine.admission).
_MEMORY_FACTORS = {"export": 2.0, "edge": 0.2, "compile": 0.5, "blob": 1.0, "package": 1.2, "reference": 1.0,
                   "verify": 2.0}


def _device_factor(kind: str):
    def factor(config, method) -> float:
        specs = config.specs.get(method) or {}
        if kind == "compile" and not compile_keeps_weights_on_host(specs, config.target):
            return 1.3 if specs.get("low_memory_mode") == "ON" else 2.7
        return _DEVICE_FACTORS[kind]
    return factor


def _accelerator(config, method) -> str | None:
    """Compile (tuning, and the move to the device), verify and, on cuda, the probe use the target's device."""
    return config.target if config.target != "cpu" else None


PIPELINE = Pipeline(
    [
        # On cuda the probe asks the device its capability: on a cluster it runs on a GPU worker.
        StageKind("probe", device_factor=_device_factor("probe"), version=1, per_method=False, module=STAGES + "probe", params=_probe,
                  predict_value=toolchain.predict_probe_value, device=_accelerator),
        StageKind("quantize", device_factor=_device_factor("quantize"), version=1, per_method=False, module=STAGES + "quantize", consumes=("probe",),
                  params=_quantize, applies=_quantizes, device=_quantize_device, memory_from_upstream=False,
                  values_only=_weights_options),
        # Keyed on the code and the weights' layout, not their values: another seed finds it cached.
        StageKind("trace", memory_factor=_MEMORY_FACTORS["export"], version=1, per_method=True, module=STAGES + "trace",
                  consumes=("probe", "quantize"), results={"weights": "quantize:layout"}, params=_trace),
        StageKind("export", memory_factor=_MEMORY_FACTORS["export"], version=5, per_method=True, module=STAGES + "export",
                  consumes=("probe", "quantize", "trace[m]"), results={"weights": "quantize", "graph": "trace[m]:code"},
                  params=_export, values_only=_weights_options, explains_graph=True,
                  new_weights="binds them into the traced program"),
        StageKind("edge", memory_factor=_MEMORY_FACTORS["edge"], version=5, per_method=True, module=STAGES + "edge", consumes=("probe", "export[m]"),
                  results={"graph": "export[m]:code"}, params=_edge, explains_graph=True),
        StageKind("compile", memory_factor=_MEMORY_FACTORS["compile"], device_factor=_device_factor("compile"), version=3, per_method=True, module=STAGES + "compile", consumes=("probe", "edge[m]"),
                  results={"graph": "edge[m]"}, params=_compile, explains_graph=True, runs_alone=_compile_alone,
                  device=_accelerator),
        # On cuda it may have to compile (a constant table it cannot trust): it claims the device.
        StageKind("blob", memory_factor=_MEMORY_FACTORS["blob"], device_factor=_device_factor("blob"), version=2, per_method=True, module=STAGES + "blob",
                  consumes=("probe", "export[m]", "edge[m]", "compile[m]"),
                  results={"weights": "export[m]", "code": "edge[m]", "compiled": "compile[m]"}, params=_blob,
                  device=_accelerator),
        StageKind("package", memory_factor=_MEMORY_FACTORS["package"], version=4, per_method=False, module=STAGES + "package",
                  consumes=("probe", "export[*]", "blob[*]"), results={"graph": "export[*]", "compiled": "blob[*]"},
                  params=_package, final_outputs=True),
        # After compile and package in the table, so that a free worker takes it only once nothing
        # on the way to the package is waiting: it is off that chain.
        StageKind("reference", memory_factor=_MEMORY_FACTORS["reference"], device_factor=_device_factor("reference"), version=5, per_method=True, module=STAGES + "reference",
                  consumes=("probe", "quantize", "export[m]"), results={"graph": "export[m]", "weights": "quantize"},
                  params=_reference, applies=_reference_apart, device=_accelerator),
        StageKind("verify", memory_factor=_MEMORY_FACTORS["verify"], device_factor=_device_factor("verify"), version=4, per_method=True, module=STAGES + "verify",
                  consumes=("probe", "export[m]", "edge[m]", "blob[m]", "package", "reference[m]"),
                  results={"graph": "export[m]", "compiled": "blob[m]", "reference": "reference[m]"}, params=_verify,
                  device=_accelerator),
    ],
    fingerprint=toolchain.cheap_fingerprint,
    content_digests={".safetensors": safetensors_parts.tensor_digests},
    layout_digests={".safetensors": safetensors_parts.tensor_layouts},
    warm_imports=_warm_imports,
)

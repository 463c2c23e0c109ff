"""export: one method's program for this build's weights: the traced program (the trace stage's)
with the build's weights in it, put there by FQN, without torch.export.

The trace stage is keyed on the code and the weights' layout, not their values, so another seed
(an option the recipe's table marks `values_only`) or other quantized weights of the same layout find it cached. This
stage is keyed on the weights too, and gives the program for them, in one of three ways:

- *as traced*: the trace was made from this very model (its value's `weights` is this build's
  eager_model.weights_of, as in a cold build): its outputs are handed on, nothing is built;
- *bound*: the model is built (seeded, or the quantized bundle loaded with `assign`), and its
  state dict is written as the traced program's weights (programs.save_weights: the same files a
  trace of it would write), once every check below passed. The program's graph, signature,
  constants, example inputs, verify steps and metadata are the trace's; graph.json is the
  trace's with the new weights' digests, and the code digest is computed from the new weights'
  layout and the trace's constants. The value says `weights: bound`, and the summary
  "weights bound, program as traced";
- *traced*: where a check fails, one line says why and the method is torch.exported here from
  this build's model, as the trace stage would (its value's `why`).

Why the trace's constants may stay: a program's constants are its lifted tensor constants (made
by the forward's code: `torch.tensor(...)` of literals) and its non-persistent buffers and tensor
attributes (KV caches, rotary tables: made by the model's constructor from its configuration).
Neither is a weight, and for the same code and options (the trace stage's key) both come out the
same, whatever the weights. A model whose constructor draws such a buffer from the seed, or
computes it from a weight, breaks that; so every constant that is a buffer or tensor attribute of
this build's model is compared with the trace's (dtype, shape, strides and values), and so are
what the recipe's functions give for the model (the example inputs, verify steps and metadata):
any difference is a failed check. The other checks: every weight of the traced program is in the
model's state dict with the same layout (programs.weight_layout: dtype, shape, strides, offset,
storage size, device, class, requires_grad), and the model holds no state the traced model did
not. A check that passed leaves the files a trace of this model gives, byte for byte: the weight
files, graph.json and the rest, and the serialised graph too where the trace ran in the same
project (its stack traces name the source's paths).
"""

from __future__ import annotations

import json

# (quantized_folder and release_model too: the later stages import them from here.)
from cudabuild.backend.eager_model import build_model, quantized_folder, release_model, weights_of  # noqa: F401
from cudabuild.backend.programs import (TENSOR_PREFIX, graph_digest, load_example_inputs, save_weights,
                                        tensor_digest, tensors_code_summary, weight_layout, write_summary)
from cudabuild.backend.stages import trace as trace_stage
from cudabuild.engine.console.trace import phase
from cudabuild.engine.context import StageResult
from cudabuild.errors import ExportFailed, one_line


def run(ctx) -> StageResult:
    method = ctx.stage.method
    traced = ctx.upstream("trace", method)
    if (traced.value or {}).get("weights") == weights_of(ctx):
        return _as_traced(_checked(ctx, traced.outputs))
    with phase("load"):  # the model built, its checkpoint read
        recipe, model, reuse = build_model(ctx)
    spec = next(m for m in recipe.methods if m.name == method)
    try:
        if spec.prepare is not None:
            spec.prepare(model, ctx.config.options)
    except Exception as e:
        raise ExportFailed(f"method {method} of {ctx.config.model} failed to prepare: {one_line(e)}") from e
    with phase("check"):
        _checked(ctx, [name for name in traced.outputs if not name.startswith(TENSOR_PREFIX)])  # all but its weights
        constants = _traced_constants(ctx)
        why = bind_problem(ctx, recipe, spec, model, constants)
    if why is None:
        result = _bound(ctx, model, reuse, constants)
    else:
        ctx.log(f"export.{method}: {why}; tracing these weights")
        result = trace_stage.traced(ctx, recipe, model, reuse)
        result.value.update(weights="traced", why=why, note="traced for these weights: the traced program could not take them")
    if ctx.workers > 1:
        # The next method's export may run in another worker, and an idle worker's model would
        # count against no stage's admission (cudabuild.engine.workers): let it go now.
        release_model()
    return result


def _checked(ctx, names):
    """The trace's stamp once the outputs `names` (what this stage hands on) are checked: each read
    as the stages after it will read it (a weight kept as ranges of other blobs, by those blobs),
    so one that is bad has the trace run again now, as any reader's would, and is never handed on."""
    read = ctx.reader("trace", ctx.stage.method)
    for name in sorted(names):
        if read.mapped(name) is None:
            read(name)
    return ctx.upstream("trace", ctx.stage.method)


def _as_traced(traced) -> StageResult:
    """The trace's outputs, handed on: it was made from this build's model."""
    value = traced.value or {}
    return StageResult({}, digest=traced.digest, value={"nodes": value.get("nodes"), "weights": "as traced",
                                                        "facets": dict(value.get("facets") or {})},
                       stored=dict(traced.outputs))


def _traced_constants(ctx) -> dict:
    """The traced program's tensor constants by FQN (lifted constants, non-persistent buffers)."""
    import torch
    from torch._export.serde.serialize import deserialize_torch_artifact

    constants = deserialize_torch_artifact(ctx.blob("trace", ctx.stage.method, "constants.pt"))
    return {fqn: t for fqn, t in constants.items() if isinstance(t, torch.Tensor)}


def _bound(ctx, model, reuse, constants: dict) -> StageResult:
    """The traced program with `model`'s weights: their files written (or named, where `reuse`
    holds them), the trace's other outputs handed on, graph.json and the code digest for them."""
    method = ctx.stage.method
    traced = ctx.upstream("trace", method)
    index = json.loads(ctx.blob("trace", method, "weights.json"))  # fqn -> its file's name
    state = model.state_dict(keep_vars=True)
    weights = {fqn: state[fqn] for fqn in index}
    with phase("save"):
        saved = save_weights(weights, ctx.workdir, reuse, ctx.keep)
    summary = json.loads(ctx.blob("trace", method, "graph.json"))
    summary["state"] = dict(sorted(saved.weights.items()))
    files = dict(saved.files)
    files["graph.json"] = write_summary(summary, ctx.workdir / "graph.json")
    code = graph_digest(tensors_code_summary({**weights, **constants}, summary))
    stored = {name: sha for name, sha in traced.outputs.items()
              if not name.startswith(TENSOR_PREFIX) and name != "graph.json"}
    stored.update(saved.reused)
    value = {"nodes": len(summary["nodes"]), "weights": "bound", "weights_reused": len(saved.reused),
             "note": "weights bound, program as traced", "facets": {"code": code}}
    return StageResult(files, digest=graph_digest(summary), value=value, known=saved.shas, stored=stored,
                       regions=saved.regions)


def bind_problem(ctx, recipe, spec, model, constants: dict) -> str | None:
    """Why `model`'s weights cannot be put in the traced program (the module docstring's checks),
    in words; None when they can."""
    method = ctx.stage.method
    layout = json.loads(ctx.blob("trace", method, trace_stage.LAYOUT))
    state = model.state_dict(keep_vars=True)
    traced_weights = layout["weights"]
    missing = sorted(set(traced_weights) - set(state))
    if missing:
        return f"the traced program takes weight {missing[0]}, which this build's model does not have"
    untaken = sorted(set(state) - set(traced_weights))
    if untaken != layout["untaken"]:
        extra = sorted(set(untaken) ^ set(layout["untaken"]))[0]
        return f"this build's model and the traced one differ in state {extra}, which the program does not take"
    for fqn in sorted(traced_weights):
        mine = json.loads(json.dumps(weight_layout(state[fqn])))
        if mine != traced_weights[fqn]:
            what, ours, theirs = _layout_difference(mine, traced_weights[fqn])
            return f"weight {fqn} has {what} {ours} in this build's model, {theirs} in the traced program"
    for fqn, traced_constant in sorted(constants.items()):
        own = _model_tensor(model, fqn)
        if own is not None and not _same(own, traced_constant):
            return (f"constant {fqn} of the traced program differs from this build's model's (a buffer or tensor "
                    "attribute that follows the weights, not the code)")
    return _same_calls(ctx, recipe, spec, model)


def _same_calls(ctx, recipe, spec, model) -> str | None:
    """Whether the recipe's functions give for `model` what they gave for the traced one."""
    import torch

    method = ctx.stage.method
    if not _same(tuple(spec.inputs(model)), load_example_inputs(ctx.blob("trace", method, "inputs.pt"))):
        return f"the example inputs of {method} differ from the traced program's"
    if spec.verify_steps is not None:
        traced_steps = torch.load(ctx.blob_path("trace", method, "verify_steps.pt"), weights_only=True)
        if not _same([tuple(step) for step in spec.verify_steps(model)], traced_steps):
            return f"the verify steps of {method} differ from the traced program's"
    metadata = dict(recipe.constant_methods(model)) if recipe.constant_methods else {}
    if json.loads(json.dumps(metadata, sort_keys=True)) != json.loads(ctx.blob("trace", method, "metadata.json")):
        return "the constant methods' metadata differs from the traced program's"
    return None


# What each field of a plain tensor's weight_layout is, in words.
_LAYOUT_FIELDS = ("kind", "dtype", "shape", "stride", "storage offset", "storage bytes", "device", "class",
                  "requires_grad")


def _layout_difference(mine: list, traced: list) -> tuple[str, str, str]:
    """(what differs, this build's, the trace's) of two weight_layouts: the first field that differs
    of a plain tensor's, or the whole of a subclass's."""
    if mine[:1] == traced[:1] == ["T"] and len(mine) == len(traced) == len(_LAYOUT_FIELDS):
        for name, a, b in zip(_LAYOUT_FIELDS, mine, traced):
            if a != b:
                words = lambda v: f"[{', '.join(map(str, v))}]" if isinstance(v, list) else str(v)
                return name, words(a), words(b)
    return "layout", json.dumps(mine), json.dumps(traced)


def _model_tensor(model, fqn: str):
    """The model's tensor at `fqn` (a buffer or tensor attribute), or None: a lifted constant the
    forward's code made has no FQN on the model."""
    import torch

    owner = model
    for part in fqn.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner if isinstance(owner, torch.Tensor) else None


def _same(a, b) -> bool:
    """Two values equal as the recipe's functions give them: tensors by class, dtype, shape, strides
    and values; sequences and dicts item by item; the rest by ==."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_subclass

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        # A wrapper subclass (torchao's) by its class and inner tensors; a plain tensor by its
        # bytes (a Parameter and a Tensor of the same values are the same value).
        if (_is_subclass(a) or _is_subclass(b)) and type(a) is not type(b):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            return False
        return tensor_digest(a) == tensor_digest(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b

"""edge: ExecuTorch's edge lowering and the CUDA backend's graph passes, as a stored program.

The program handed to the AOTI backend is captured from a real `to_edge_transform_and_lower`
(see cudabuild.backend.delegate), its user inputs are put in the method's order (the partitioner's order
is an accident of its topological sort: cudabuild.backend.calling_convention), then the backend's
device-independent passes run in the reference's order: view_copy -> view, int64 floordiv ->
float, Triton op replacement (triton_kernel_mode=ON), conv1d -> conv2d. The one device-dependent
pass (cond predicate to CPU) runs in compile, after the move to the device, where it means
something.

Edge is keyed on the exported program's *code* (programs.code_digest: its weights' values left
out), not its content: new weights for the same model do not lower again. That holds because the
lowering reads no weight's value, which every run checks (cudabuild.backend.tensor_origins): each
tensor of the edge program is either the exported program's, handed on (the same tensor, a view,
a copy: `origins.json` says which), or the lowering's own. The stage's digest is then the edge
program's code digest (its own tensors' values kept: they come from the code), and the program
for other weights is this one with theirs put in (`tensor_origins.for_weights`, which the blob
and verify stages use). A lowering that did read a weight's values, or handed one on in a form
that cannot be followed, says so in its value (`weights_read`); its digest is then the content
digest, and the blob stage lowers again for any other weights rather than reuse this program.
"""

from __future__ import annotations

import json

from cudabuild.backend import calling_convention, delegate, op_listing, tensor_origins
from cudabuild.errors import CompileFailed, one_line
from cudabuild.backend import custom_ops
from cudabuild.backend.programs import StoredWeights, load_program, program_tensors
from cudabuild.backend.stages.export import release_model
from cudabuild.backend.stages.program_result import program_result
from cudabuild.engine.context import StageResult
from cudabuild.engine.console.trace import phase


def backend_passes(ep, specs: dict):
    import torch
    from executorch.backends.aoti.passes.replace_view_copy_with_view import ReplaceViewCopyWithViewPass
    from executorch.backends.cuda.passes.replace_int64_floordiv import ReplaceInt64FloorDivWithFloatPass
    from torch._inductor.decomposition import conv1d_to_conv2d

    ReplaceViewCopyWithViewPass()(ep.graph_module)
    ReplaceInt64FloorDivWithFloatPass()(ep.graph_module)
    if specs.get("triton_kernel_mode", "ON") == "ON":
        from executorch.backends.cuda.triton.replacement_pass import ReplaceEdgeOpWithTritonOpPass

        ReplaceEdgeOpWithTritonOpPass()(ep.graph_module)
    return ep.run_decompositions({torch.ops.aten.conv1d.default: conv1d_to_conv2d})


ORIGINS = "origins.json"


def lower(ctx, ep, reuse: StoredWeights) -> tuple:
    """The method's edge program from its exported program `ep` (weights `reuse` holds are shared,
    not copied), and what the lowering did with `ep`'s tensors (tensor_origins.Watch)."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    method = ctx.stage.method
    # ExecuTorch's own CUDA exporters lower without dim-order ops; a recipe that follows one says so.
    skip_dim_order = bool((ctx.config.description.get("lowering") or {}).get("skip_dim_order"))
    with tensor_origins.watched(ep) as watch, op_listing.listed_once():  # lowering decomposes twice, passes once more
        try:
            with delegate.capture() as captured, reuse.shared_when_copied():
                lowered = to_edge_transform_and_lower(
                    {method: ep},
                    partitioner={method: [delegate.partitioner(method, {}, ctx.config.target)]},
                    compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=skip_dim_order),
                )
        except Exception as e:
            raise CompileFailed(f"method {method}: edge lowering failed: {one_line(e)}") from e
        programs = captured.get(method, [])
        if len(programs) != 1:
            raise CompileFailed(f"method {method}: expected the whole graph in one AOTI partition, got {len(programs)}")
        positions = calling_convention.delegate_input_positions(lowered.exported_program(method), method)
        with reuse.shared_when_copied():
            edge = backend_passes(programs[0], ctx.config.specs[method])
    delegate.forget_lowered_graphs()  # the passes compare nodes too (see there)
    calling_convention.reorder_user_inputs(edge, positions)
    _check_inputs_match(ep, edge, sorted(positions), method)
    return edge, watch


def run(ctx) -> StageResult:
    method = ctx.stage.method
    release_model()
    reuse = StoredWeights()  # the exported weights, mapped from the store: handed on, not copied
    custom_ops.register(ctx.config.target)  # the ops its programs call
    with phase("load"):
        ep = load_program(ctx.reader("export", method), reuse)
    edge, watch = lower(ctx, ep, reuse)
    found, unknown = tensor_origins.origins(watch, edge)
    result = program_result(edge, ctx.workdir, reuse, own=set(program_tensors(edge)) - set(found), keep=ctx.keep)
    result.files[ORIGINS] = ctx.workdir / ORIGINS
    result.files[ORIGINS].write_text(json.dumps(found, sort_keys=True))
    read = watch.reads + [f"{fqn} is handed on in a form that cannot be followed" for fqn in unknown[:1]]
    result.value["lowered_from"] = ctx.upstream("export", method).digest
    if read:
        # Its program holds values computed from these weights: downstream follows its content.
        result.value["weights_read"] = {"count": watch.read_count + len(unknown), "first": read}
    else:
        result.digest = result.value["facets"]["code"]
    return result


def _check_inputs_match(exported, edge, read: list[int], method: str) -> None:
    """The edge program must take the exported method's inputs (those it reads), in the method's
    order: the compiled .so is called that way by verify, the package's delegate call and the runtime."""
    def user_inputs(ep):  # dtype and static dims of each (symbol names differ between programs)
        names = set(ep.graph_signature.user_inputs)
        vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in names]
        return [(str(v.dtype), [d if isinstance(d, int) else "dynamic" for d in v.shape]) if hasattr(v, "shape")
                else type(v).__name__ for v in vals]

    everything = user_inputs(exported)
    want, got = [everything[i] for i in read], user_inputs(edge)
    if want != got:
        raise CompileFailed(f"method {method}: the edge program takes inputs {got}, the method {want}")

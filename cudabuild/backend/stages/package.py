"""package: one .pte + one .ptd for all methods, in the layout the ExecuTorch CUDA runtime reads.

Each method is lowered through ExecuTorch as a stand-in with its calling convention (see
cudabuild.backend.standin: no weights loaded, no edge passes over the model; the same bytes), or, where a
stand-in cannot reproduce it, as its exported program. cudabuild's backend in emit mode hands back
the stored .so and weights blob per method (the blob stage's: cudabuild.backend.stages.blob), each delegate call is made to pass the method's inputs
in the method's order, the order the .so was compiled for (cudabuild.backend.calling_convention), and the
delegates are renamed to the runtime's id.
Weights blobs shared by several methods are stored once in the .ptd (named data is keyed by
content).
"""

from __future__ import annotations

import json
from pathlib import Path

from cudabuild.backend import calling_convention, delegate, op_listing, standin
from cudabuild.errors import CompileFailed, one_line
from cudabuild.backend import custom_ops
from cudabuild.backend.programs import load_program
from cudabuild.backend.stages.export import release_model
from cudabuild.engine.context import StageResult
from cudabuild.specs import serialized

PTE = "model.pte"


def ptd_name(target: str) -> str:
    return f"aoti_{target}_blob.ptd"


def run(ctx) -> StageResult:
    config = ctx.config
    methods = config.methods
    custom_ops.register(ctx.config.target)  # the ops its programs call
    programs, relowered = {}, {}
    for m in methods:
        try:
            programs[m] = standin.stand_in_program(json.loads(ctx.blob("export", m, "graph.json")))
        except standin.Unsupported as e:
            programs[m] = load_program(ctx.reader("export", m))
            relowered[m] = str(e)
    release_model()
    weights: dict[str, bytes] = {}  # by sha256, filled by _read_once
    compiled = {}
    for m in methods:
        sha = ctx.upstream("blob", m).outputs["weights.blob"]
        compiled[m] = delegate.Compiled(ctx.blob("blob", m, "model.so"), _read_once(ctx, m, sha, weights), sha)
    files = write_package(
        programs, compiled, {m: serialized(config.specs[m]) for m in methods}, config.target,
        json.loads(ctx.blob("export", methods[0], "metadata.json")), ctx.workdir, config.model,
        config.description.get("lowering"),
    )
    # The .ptd's segments are the weights blobs: the store keeps it as ranges of them (cudabuild.engine.spans).
    regions = {name: ptd_regions(path) for name, path in files.items() if name.endswith(".ptd")}
    return StageResult(files, value={"stand_in": [m for m in methods if m not in relowered], "relowered": relowered},
                       regions=regions)


def ptd_regions(path: Path) -> list[tuple[int, int]]:
    """[(offset, length)] of each segment (a weights blob) of an ExecuTorch .ptd, from its header
    and flatbuffer alone; [] for a file it cannot read."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    try:
        with open(path, "rb") as f:
            head = f.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
            header = FlatTensorHeader.from_bytes(head[8:])
            if not header.is_valid():
                return []
            f.seek(0)
            flat = _deserialize_to_flat_tensor(f.read(header.flatbuffer_offset + header.flatbuffer_size))
        return [(header.segment_base_offset + s.offset, s.size) for s in flat.segments]
    except Exception:  # a layout this ExecuTorch does not describe: stored plainly, as before
        return []


def _read_once(ctx, method: str, sha: str, read: dict) -> bytes:
    """A method's weights blob, read into memory once per distinct blob (`read`: sha256 -> bytes):
    the methods' blobs hold the same weights, and one copy of tens of GB is what packaging may hold."""
    if sha not in read:  # streamed: a blob kept as ranges of others is not written out to be read
        read[sha] = ctx.blob("blob", method, "weights.blob")
    return read[sha]


def write_package(programs: dict, compiled: dict, specs: dict, target: str, metadata: dict, workdir: Path,
                  model: str, lowering: dict | None = None) -> dict[str, Path]:
    """Lower {method: program} with each method's compiled .so and weights blob as its delegate;
    write the .pte and .ptd into workdir and return them by name. `lowering` is the recipe's own
    lowering settings (cudabuild.recipe.Lowering.as_data), or None for ExecuTorch's defaults."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    methods = list(programs)
    lowering = lowering or {}
    partitioners = {m: [delegate.partitioner(m, specs[m], target)] for m in methods}
    pte = workdir / PTE
    try:
        with op_listing.listed_once(), delegate.emit(compiled.__getitem__, target):
            edge = to_edge_transform_and_lower(
                programs,
                partitioner=partitioners,
                compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                 _skip_dim_order=bool(lowering.get("skip_dim_order"))),
                constant_methods=metadata or None,
            )
            calling_convention.call_delegates_in_method_order(edge, methods)
            renamed = delegate.rename_delegates(edge, methods, target)
            if renamed != len(methods):
                raise CompileFailed(f"packaging {model}: expected one delegate per method, found {renamed}")
            program = edge.to_executorch(backend_config(lowering))
            with open(pte, "wb") as f:
                program.write_to_file(f)
            program.write_tensor_data_to_file(str(workdir))
    except CompileFailed:
        raise
    except Exception as e:
        raise CompileFailed(f"packaging {model} failed: {one_line(e)}") from e
    files = {PTE: pte}
    for path in workdir.glob("*.ptd"):
        files[path.name] = path
    if ptd_name(target) not in files:
        raise CompileFailed(f"packaging {model}: ExecuTorch wrote no {ptd_name(target)}")
    return files


def backend_config(lowering: dict):
    """ExecuTorch's to_executorch settings: its defaults, or the recipe's where it declares them."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    if not lowering:
        return None
    return ExecutorchBackendConfig(
        extract_delegate_segments=lowering["extract_delegate_segments"],
        do_quant_fusion_and_const_prop=lowering["do_quant_fusion_and_const_prop"],
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=lowering["alloc_graph_input"]),
        emit_mutable_buffer_names=lowering["emit_mutable_buffer_names"],
    )

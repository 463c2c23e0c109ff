"""package: one .pte + one .ptd for all methods, in the layout the ExecuTorch CUDA runtime reads.

The methods' exported programs are lowered again through ExecuTorch (cheap: nothing compiles),
with cudabuild's backend in emit mode handing back the stored .so and weights blob per method,
and the delegates renamed to the runtime's id. Weights blobs shared by several methods are stored
once in the .ptd (named data is keyed by content).
"""

from __future__ import annotations

import json

from .. import delegate
from ..errors import CompileFailed, one_line
from ..programs import load_program
from ..runner import StageResult

PTE = "model.pte"


def ptd_name(target: str) -> str:
    return f"aoti_{target}_blob.ptd"


def run(ctx) -> StageResult:
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    config = ctx.config
    methods = config.methods
    programs = {m: load_program(lambda name, m=m: ctx.blob("export", m, name)) for m in methods}
    metadata = json.loads(ctx.blob("export", methods[0], "metadata.json"))
    compiled = {
        m: delegate.Compiled(ctx.blob("compile", m, "model.so"), ctx.blob("compile", m, "weights.blob"))
        for m in methods
    }
    partitioners = {m: [delegate.partitioner(m, dict(config.specs[m]), config.target)] for m in methods}
    try:
        with delegate.emit(compiled.__getitem__, config.target):
            edge = to_edge_transform_and_lower(
                programs,
                partitioner=partitioners,
                compile_config=EdgeCompileConfig(_check_ir_validity=False),
                constant_methods=metadata or None,
            )
        renamed = delegate.rename_delegates(edge, methods, config.target)
        program = edge.to_executorch()
    except Exception as e:
        raise CompileFailed(f"packaging {config.model} failed: {one_line(e)}") from e
    if renamed != len(methods):
        raise CompileFailed(f"packaging {config.model}: expected one delegate per method, found {renamed}")
    pte = ctx.workdir / PTE
    with open(pte, "wb") as f:
        program.write_to_file(f)
    program.write_tensor_data_to_file(str(ctx.workdir))
    files = {PTE: pte}
    for path in ctx.workdir.glob("*.ptd"):
        files[path.name] = path
    if ptd_name(config.target) not in files:
        raise CompileFailed(f"packaging {config.model}: ExecuTorch wrote no {ptd_name(config.target)}")
    return StageResult(files)

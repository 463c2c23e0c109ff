"""blob: one method's compiled code and its weights blob for this build's weights -> model.so + weights.blob.

The compile stage is keyed on what decides the code, not on the weights' values, so new weights
for the same model (another seed, a new checkpoint of the same shapes) find its .so cached. This
stage is keyed on the weights (the exported program's content digest), the edge program and the
compile's result, and gives the .so with the blob for these weights. The compile writes no blob
of its own (it proves its constant table on what AOTInductor's would hold, which it never builds:
aoti_constants.captured_table), so the blob is written here, in one of three ways:

- *as compiled*: the compile's program held these very weights (its value's `lowered_from` is the
  exported program's digest): the .so is handed on and the blob written by its constant table;
- *rewritten*: the same, for other weights than the compile's program held: the blob is written
  by the compile's constant table (cudabuild.backend.aoti_constants.write_blob), from the edge
  program for these weights (`lowered_program`: the edge program's graph and own tensors, and the
  exported program's tensors where the edge lowering handed them on, cudabuild.backend.tensor_origins);
  byte for byte what AOTInductor would write, which the compile proved on its constants' values. Either
  way the constants whose bytes the store holds already (every weight, from the bundle or the
  export) are holes in the file written, and the store keeps the blob as ranges of them: a
  weights blob of 20 GB takes a manifest on the disk, not a copy;
- *compiled*: where the shortcut cannot be trusted, one line says why and the method is compiled
  here, in the compile stage's own inductor dir (so its bytes are what a compile of these weights
  gives): the compile's constant table is malformed, was not proven on its own blob, is not the
  .so's own (read from the .so on the CPU), or does not fit these weights (a constant of another
  dtype, shape, strides, offset or size); or the edge lowering read the weights' values (then
  the method is lowered again too).

The value says which (`blob`, and a `note` the build's summary shows), and why where it compiled.
Package and verify take the .so and the blob from here.
"""

from __future__ import annotations

import json

from cudabuild.backend import aoti_constants, custom_ops, tensor_origins
from cudabuild.backend.programs import StoredWeights, load_program, load_tensors, save_program
from cudabuild.backend.stages import compile as compile_stage
from cudabuild.backend.stages import edge as edge_stage
from cudabuild.backend.stages.export import release_model
from cudabuild.engine.console.trace import phase
from cudabuild.engine.context import StageResult

OUTPUTS = ("model.so", "weights.blob")


def lowered_tensors(ctx, method: str, mapped: StoredWeights | None = None) -> dict:
    """The edge program's tensors (by FQN) for this build's weights: the edge stage's own, and the
    exported program's where the lowering handed them on (weights mapped from the store)."""
    origins = json.loads(ctx.blob("edge", method, edge_stage.ORIGINS))
    # The edge program's handed-on weights are another export's: not read (nor fetched from a tier).
    own = load_tensors(ctx.reader("edge", method), mapped, skip=frozenset(origins))
    return tensor_origins.for_weights(own, origins, load_tensors(ctx.reader("export", method), mapped))


def lowered_program(ctx, method: str, mapped: StoredWeights | None = None):
    """The edge program for this build's weights: the edge stage's graph with `lowered_tensors`."""
    program = load_program(ctx.reader("edge", method), mapped)
    tensor_origins.put(program, lowered_tensors(ctx, method, mapped))
    return program


def run(ctx) -> StageResult:
    method = ctx.stage.method
    weights = ctx.inputs["weights"]
    compiled = ctx.upstream("compile", method)
    as_compiled = (compiled.value or {}).get("lowered_from") == weights
    release_model()
    custom_ops.register(ctx.config.target)  # the ops the programs call
    read = (ctx.upstream("edge", method).value or {}).get("weights_read")
    if read:
        why = (f"edge.{method} read the weights' values while lowering ({read['first'][0]}), so its program "
               "holds values of other weights")
        return _compiled(ctx, why, lower_again=True)
    with phase("load"):
        mapped = StoredWeights()
        tensors = lowered_tensors(ctx, method, mapped)
    table, why = _table(ctx, compiled)
    why = why or aoti_constants.fit_problem(table, tensors)
    if why:
        del tensors, mapped
        return _compiled(ctx, why, lower_again=False)
    path = ctx.workdir / "weights.blob"
    with phase("write"):
        # The bytes the store holds already (the weights, kept once) are left out: holes.
        sha, regions = aoti_constants.write_blob(path, table, tensors, stored=ctx.holds)
    value = {"blob": "as compiled"} if as_compiled else {"blob": "rewritten", "note": "weights blob rewritten, code as compiled"}
    return StageResult({"weights.blob": path}, value=value, known={"weights.blob": sha}, regions={"weights.blob": regions},
                       stored={"model.so": compiled.outputs["model.so"]})


def _table(ctx, compiled) -> tuple[dict | None, str | None]:
    """The compile's constant table, or why it cannot be used, in words."""
    method = ctx.stage.method
    constants = (compiled.value or {}).get("constants") or {}
    if not constants.get("rewritable"):
        return None, f"compile.{method}'s constant table was not proven on its own blob ({constants.get('why', 'not checked')})"
    table = aoti_constants.read_table(ctx.blob("compile", method, "constants.json"))
    if isinstance(table, str):
        return None, f"compile.{method}: {table}"
    if ctx.config.target == "cpu":  # the .so's own table, read through its C API (the CPU needs no device)
        try:
            aoti_constants.promote_libtorch("cpu")
            so_table = aoti_constants.constants_table(str(ctx.blob_path("compile", method, "model.so")))
        except (OSError, RuntimeError) as e:
            return None, f"compile.{method}'s .so gave no constant table ({e})"
        problem = aoti_constants.so_table_problem(table, so_table)
        if problem:
            return None, f"compile.{method}'s constant table is not its .so's: {problem}"
    return table, None


def _compiled(ctx, why: str, lower_again: bool) -> StageResult:
    """The method compiled here for these weights (lowered again first where `lower_again`), in
    the compile stage's inductor dir; `why` is said in one line."""
    method = ctx.stage.method
    ctx.log(f"blob.{method}: {why}; compiling for these weights")
    compiled = ctx.upstream("compile", method)

    def load(mapped):
        if not lower_again:
            return lowered_program(ctx, method, mapped)
        exported = load_program(ctx.reader("export", method), mapped)
        lowered = edge_stage.lower(ctx, exported, mapped)[0]
        # Through the store's form, as the compile stage gets its edge program: what inductor names
        # and orders follows the deserialised graph, so only that gives the compile stage's bytes.
        saved = save_program(lowered, ctx.workdir / "edge", mapped)
        read = lambda name: saved.files[name] if name in saved.files else ctx.handed_on(saved.reused[name])
        return load_program(read, mapped)

    result = compile_stage.compile_program(ctx, load, key=compiled.key, graph=compiled.inputs["graph"],
                                           lowered_from=ctx.inputs["weights"], keep_blob=True)
    files = {name: result.files[name] for name in OUTPUTS}
    return StageResult(files, value={"blob": "compiled", "why": why, "note": "compiled for these weights: the shortcut was refused",
                                     "compile": result.value},
                       known={name: result.known[name] for name in OUTPUTS if name in result.known})

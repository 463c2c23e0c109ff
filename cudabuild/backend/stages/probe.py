"""probe: the full toolchain description (torch, triton, executorch, compiler; CUDA plan on cuda)."""

from __future__ import annotations

import json

from cudabuild.engine.hashing import digest
from cudabuild.engine.context import StageResult
from cudabuild.backend.toolchain import probe


def run(ctx) -> StageResult:
    value = probe(ctx.config.target)
    path = ctx.workdir / "toolchain.json"
    path.write_text(json.dumps(value, indent=1, sort_keys=True))
    return StageResult({"toolchain.json": path}, digest=digest(value), value=value)

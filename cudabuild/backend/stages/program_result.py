"""The result of a stage whose output is a program (export, edge).

The program is saved as its parts (cudabuild.backend.programs), its canonical summary beside them
as `graph.json` (what `explain` diffs). The result carries two digests of it: the summary's
(`graph_digest`: the graph and every tensor's content), which is the stage's digest unless the
stage says otherwise, and its code digest (`code_digest`: the same with the weights' values left
out), in the value as the facet `code` (cudabuild.engine.graph). Downstream keys follow the graph and the weights, not the bytes of
the serialisation; what compiles code follows the code digest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from cudabuild.backend.programs import (StoredWeights, code_digest, graph_digest, graph_summary, save_program,
                                        write_summary)
from cudabuild.engine.context import StageResult
from cudabuild.engine.console.trace import phase


def program_result(ep, workdir: Path, reuse: Optional[StoredWeights], own: Optional[set] = None,
                   keep=None) -> StageResult:
    """Save `ep` into `workdir` (weights `reuse` knows are named, not written; each weight file
    stored as it is written, with `keep`: StageContext.keep) and describe it. The value counts the
    graph's nodes and the weights handed on already stored, and holds the code digest, in which
    the tensors named in `own` keep their values (programs.code_summary)."""
    with phase("save"):
        saved = save_program(ep, workdir, reuse, keep)
    summary = graph_summary(ep, saved.weights)
    files = dict(saved.files)
    files["graph.json"] = write_summary(summary, workdir / "graph.json")
    code = code_digest(ep, summary, own)
    return StageResult(files, digest=graph_digest(summary),
                       value={"nodes": len(summary["nodes"]), "weights_reused": len(saved.reused), "facets": {"code": code}},
                       known=saved.shas, stored=saved.reused, regions=saved.regions)

"""The result of a stage whose output is a program (export, edge).

The program is saved as its parts (cudabuild.backend.programs), its canonical summary beside them
as `graph.json` (what `explain` diffs), and the stage's digest is the summary's: downstream keys
follow the graph and weights, not the bytes of the serialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from cudabuild.backend.programs import StoredWeights, graph_digest, graph_summary, save_program, write_summary
from cudabuild.engine.runner import StageResult
from cudabuild.engine.console.trace import phase


def program_result(ep, workdir: Path, reuse: Optional[StoredWeights]) -> StageResult:
    """Save `ep` into `workdir` (weights `reuse` knows are named, not written) and describe it.
    The value counts the graph's nodes and the weights handed on already stored."""
    with phase("save"):
        saved = save_program(ep, workdir, reuse)
    summary = graph_summary(ep, saved.weights)
    files = dict(saved.files)
    files["graph.json"] = write_summary(summary, workdir / "graph.json")
    return StageResult(files, digest=graph_digest(summary),
                       value={"nodes": len(summary["nodes"]), "weights_reused": len(saved.reused)},
                       known=saved.shas, stored=saved.reused)

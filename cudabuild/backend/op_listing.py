"""One listing of torch's composite-implicit ops per lowering, instead of one per decomposition.

Each `ExportedProgram.run_decompositions` starts by listing every preservable
CompositeImplicitAutograd op of every op namespace (`torch._export.utils._collect_all_valid_cia_ops`,
a walk over some 230 namespaces: 0.15 s here). An ExecuTorch lowering decomposes each method
twice, and the edge passes once more, so a two-method build lists them ten times or more; the
plain one-call ExecuTorch script lists them half as often. torch itself memoises only the aten
namespace's part, because any other namespace gains ops when a library registers some.

Inside `listed_once()`, the listing is made once and reused while the set of namespaces stays the
same (the blocks are one lowering each, which registers no operators). Outside it, and on a torch
whose internals have moved, nothing changes. The backend's own code: the engine knows nothing of
torch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

# Where torch calls the listing from (the name is bound by import in each module).
_CALLERS = ("torch.export.exported_program", "torch.export.decomp_utils")


@contextlib.contextmanager
def listed_once() -> Iterator[None]:
    import importlib

    import torch

    modules = [importlib.import_module(name) for name in _CALLERS]
    originals = [getattr(m, "_collect_all_valid_cia_ops", None) for m in modules]
    list_ops = next((o for o in originals if o is not None), None)
    if list_ops is None:
        yield
        return
    memo: dict = {}

    def listing():
        namespaces = tuple(torch.ops._dir)  # a namespace registered since: list again
        if namespaces not in memo:
            memo.clear()
            memo[namespaces] = list_ops()
        return memo[namespaces]

    patched = [m for m, o in zip(modules, originals) if o is not None]
    for m in patched:
        m._collect_all_valid_cia_ops = listing
    try:
        yield
    finally:
        for m, o in zip(modules, originals):
            if o is not None:
                m._collect_all_valid_cia_ops = o

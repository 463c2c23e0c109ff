"""package lowers stand-ins with each method's calling convention instead of the exported programs
(cudabuild.backend.standin): the .pte and .ptd must be the very bytes the real programs lower to, and a
signature a stand-in cannot reproduce must be refused, so that package lowers the real program."""

from __future__ import annotations

import json

import pytest
import sympy
import torch

from _faults import stamp
from conftest import REPO

from cudabuild.backend import standin
from cudabuild.backend.programs import graph_summary
from cudabuild.engine.store import Store

METHODS = ("decode", "prefill")


def test_signature_of_a_dynamic_prefill(built_tiny):
    store = Store(built_tiny.cache)
    try:
        summary = json.loads(store.objects.read_bytes(stamp(built_tiny, "export.prefill")["outputs"]["graph.json"]))
    finally:
        store.close()
    sig = standin.signature(summary)
    (T, (lo, hi)), = sig.ranges.items()
    assert T == sympy.Symbol(T.name, integer=True, positive=True) and (lo, hi) == (2, 63)
    assert [(i.dtype, i.shape) for i in sig.inputs] == [(torch.int64, (1, T)), (torch.int64, (T,))]
    assert [(o.dtype, o.shape) for o in sig.outputs] == [(torch.float32, (1, T, 512))]


@pytest.mark.slow
def test_stand_ins_package_to_the_bytes_the_exported_programs_do(built_tiny):
    assert stamp(built_tiny, "package")["value"] == {"stand_in": list(METHODS), "relowered": {}}
    # bench/package_identity.py lowers the exported programs through package's own write_package
    # with the same compiled blobs, and compares sha256 with what the build put in build/.
    done = built_tiny.run(str(REPO / "bench" / "package_identity.py"), "tiny_lm", "cpu")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["files"] == {"model.pte": True, "aoti_cpu_blob.ptd": True} and result["identical"] is True


class Reads:
    """Toy modules for the signatures a stand-in must refuse."""

    class UnreadInput(torch.nn.Module):
        def forward(self, x, unused):
            return x * 2

    class TransposedOutput(torch.nn.Module):
        def forward(self, x):
            return (x * 2).transpose(0, 1)

    class HalvedDim(torch.nn.Module):
        def forward(self, x):
            return x[::2].clone()  # (n + 1) // 2 elements

    class IntOutput(torch.nn.Module):
        def forward(self, x):
            return x * 2, 3


@pytest.mark.parametrize("module, inputs, shapes, refusal", [
    (Reads.UnreadInput(), (torch.ones(3), torch.ones(2)), None, "input 1 is never read"),
    (Reads.TransposedOutput(), (torch.ones(3, 4),), None, "output 0 is not contiguous"),
    (Reads.HalvedDim(), (torch.ones(8),), ({0: torch.export.Dim("n", min=3, max=64)},), "is not a sum of products"),
    (Reads.IntOutput(), (torch.ones(3),), None, "output 1 is not a tensor"),
])
def test_signatures_a_stand_in_cannot_reproduce_are_refused(module, inputs, shapes, refusal):
    summary = json.loads(json.dumps(graph_summary(torch.export.export(module, inputs, dynamic_shapes=shapes))))
    with pytest.raises(standin.Unsupported, match=refusal):
        standin.stand_in_program(summary)


def test_a_stand_in_has_the_calling_convention_it_copies():
    class TwoOutputs(torch.nn.Module):
        def forward(self, tokens, scale):
            return tokens.float().unsqueeze(-1) * scale, tokens.sum(dim=1)

    n = torch.export.Dim("n", min=2, max=30)
    real = torch.export.export(TwoOutputs(), (torch.ones(1, 5, dtype=torch.int64), torch.ones(4)),
                               dynamic_shapes=({1: n}, None))
    stand_in = standin.stand_in_program(json.loads(json.dumps(graph_summary(real))))

    def convention(ep):
        placeholders = [p for p in ep.graph.nodes if p.op == "placeholder"]
        outputs = list(ep.graph.output_node().args[0])
        meta = lambda v: (v.dtype, [str(s) if not isinstance(s, int) else s for s in v.shape])
        return ([meta(p.meta["val"]) for p in placeholders], [meta(o.meta["val"]) for o in outputs],
                sorted(str(r) for r in ep.range_constraints.values()))

    ins, outs, ranges = convention(stand_in)
    real_ins, real_outs, real_ranges = convention(real)
    rename = dict(zip(sorted({s for _, shape in real_ins for s in shape if isinstance(s, str)}),
                      sorted({s for _, shape in ins for s in shape if isinstance(s, str)})))
    same_names = lambda items: [(d, [rename.get(s, s) if isinstance(s, str) else s for s in shape]) for d, shape in items]
    assert (ins, outs, ranges) == (same_names(real_ins), same_names(real_outs), real_ranges)

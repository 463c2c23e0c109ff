"""op_listing.listed_once: torch's list of composite-implicit ops, made once per lowering block,
and made again when a namespace of ops appears; decompositions come out the same either way."""

from __future__ import annotations

import torch
import torch.export.exported_program as exported_program_module
from torch import nn

from cudabuild.backend.op_listing import listed_once


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.silu(self.lin(x)).softmax(-1)


def test_a_block_lists_the_ops_once_and_decomposes_as_torch_does(monkeypatch):
    calls = []
    real = exported_program_module._collect_all_valid_cia_ops

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(exported_program_module, "_collect_all_valid_cia_ops", counted)
    ep = torch.export.export(Small().eval(), (torch.randn(2, 8),))
    plain = [ep.run_decompositions({}).graph_module.code, ep.run_decompositions().graph_module.code]
    outside = len(calls)
    assert outside >= 2

    with listed_once():
        inside = [ep.run_decompositions({}).graph_module.code, ep.run_decompositions().graph_module.code]
        once = len(calls) - outside
        torch.library.define("cudabuild_op_listing_test::twice", "(Tensor x) -> Tensor")
        torch.ops.cudabuild_op_listing_test.twice  # a new namespace: the next listing is made anew
        ep.run_decompositions({})
        again = len(calls) - outside - once
    assert inside == plain
    assert once == 1 and again == 1
    assert exported_program_module._collect_all_valid_cia_ops is counted  # put back

"""A delegated method takes the method's inputs in the method's order, whatever order ExecuTorch's
partitioner gives its delegate (cudabuild.backend.calling_convention).

The model here reads its second input first, so the partitioner's delegate takes (input_pos,
tokens) on every torch; on torch 2.11 tiny_lm's decode came out that way too, and the .so,
called with (tokens, input_pos), computed decode wrong without any error (both hold one element).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_ok

from cudabuild.backend import calling_convention, delegate

RECIPE = '''"""reads_pos_first: a decode step whose forward reads input_pos before tokens.

    doit export model=reads_pos_first target=cpu
"""

import torch
from torch import nn

from cudabuild.recipe import Method, Recipe


class ReadsPosFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, 8)
        self.tok = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens, input_pos):  # tokens [1, 1], input_pos [1]
        where = self.pos(input_pos)  # first use: the partitioner's delegate takes input_pos first
        return self.head(self.tok(tokens) + where)


def build(options):
    torch.manual_seed(options["seed"])
    return ReadsPosFirst().eval()


RECIPE = Recipe(
    build=build,
    methods=(Method("decode", inputs=lambda model: (torch.tensor([[7]]), torch.tensor([3]))),),
    options={"seed": 0},
)
'''


def model_and_inputs():
    namespace: dict = {}
    exec(compile(RECIPE, "reads_pos_first.py", "exec"), namespace)
    model = namespace["build"]({"seed": 0})
    return model, (torch.tensor([[7]]), torch.tensor([3]))


def lower(model, inputs):
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    return to_edge_transform_and_lower(
        {"decode": torch.export.export(model, inputs, strict=False)},
        partitioner={"decode": [delegate.partitioner("decode", {}, "cpu")]},
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )


def test_the_captured_program_is_put_in_the_methods_input_order():
    model, inputs = model_and_inputs()
    with delegate.capture() as captured:
        manager = lower(model, inputs)
    positions = calling_convention.delegate_input_positions(manager.exported_program("decode"), "decode")
    assert positions == [1, 0], "the model must make the partitioner swap its inputs, or this test tests nothing"
    program = captured["decode"][0]
    with pytest.raises(Exception):  # as ExecuTorch hands it over, it takes (input_pos, tokens)
        program.module()(*inputs)

    calling_convention.reorder_user_inputs(program, positions)
    shapes = [n.meta["val"].shape for n in program.graph.nodes if n.name in program.graph_signature.user_inputs]
    assert shapes == [torch.Size([1, 1]), torch.Size([1])]
    with torch.no_grad():
        assert torch.equal(program.module()(*inputs)[0], model(*inputs))


def test_the_package_calls_each_delegate_with_the_methods_inputs_in_order():
    model, inputs = model_and_inputs()
    with delegate.emit(lambda method: delegate.Compiled(b"so", b"weights"), "cpu"):
        manager = lower(model, inputs)
    assert calling_convention.call_delegates_in_method_order(manager, ["decode"]) == ["decode"]
    outer = manager.exported_program("decode")
    call = calling_convention.delegate_call(outer, "decode")
    assert [a.name for a in call.args[1:]] == list(outer.graph_signature.user_inputs)
    lowered = getattr(outer.graph_module, call.args[0].target)
    with torch.no_grad():
        assert torch.equal(lowered.original_module.module()(*inputs)[0], model(*inputs))
    assert calling_convention.call_delegates_in_method_order(manager, ["decode"]) == []  # now in order
    delegate.rename_delegates(manager, ["decode"], "cpu")
    assert manager.to_executorch().buffer  # the rewritten call still serializes


@pytest.mark.slow
def test_a_method_whose_delegate_the_partitioner_reorders_builds_verifies_and_packages_in_order(project):
    from executorch.exir._serialize._program import deserialize_pte_binary

    (project.root / "recipes" / "reads_pos_first.py").write_text(RECIPE)
    assert_ok(project.export("model=reads_pos_first", "target=cpu"))
    manifest = project.manifest("reads_pos_first", "cpu")
    assert manifest["verify"]["decode"]["passed"] is True  # verify calls the .so with (tokens, input_pos)

    pte = deserialize_pte_binary((project.root / "build/reads_pos_first/cpu/model.pte").read_bytes()).program
    plan, = (p for p in pte.execution_plan if p.name == "decode")
    calls = [i.instr_args for chain in plan.chains for i in chain.instructions if hasattr(i.instr_args, "delegate_index")]
    assert len(calls) == 1 and calls[0].args[:len(plan.inputs)] == plan.inputs  # the runtime passes them in order

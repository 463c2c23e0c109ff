"""The order in which a delegated method takes its inputs: always the method's own order.

ExecuTorch builds a delegate's program from the partition's nodes (`create_submodule_from_nodes`):
its placeholders are made in the order a topological sort of those nodes first uses them, and the
outer program calls the delegate with its inputs in that order, which need not be the method's.
A forward that reads its second input first gives (pos, x) for (x, pos) on any torch, and torch
2.11's topological sort, a FIFO queue (2.13's keeps the graph's order), puts `arange` and the
`input_pos` mask before the token embedding, so tiny_lm's decode delegate takes (input_pos, tokens).
ExecuTorch agrees with itself, but everything that calls the compiled .so with the method's inputs
then feeds it swapped ones: verify through torch's AOTI runner, and the stand-in package, whose
delegate call takes the method's inputs in order. With tokens [1, 1] and input_pos [1] (one
element each) nothing notices, and decode comes out wrong (issue: cuda decode miscompile).

cudabuild makes the order a fixed convention instead of an accident of the partitioner: the edge
stage puts the captured program's user inputs in the method's order (so the compiled .so takes
them so), and the package stage rewrites each delegate call, with its lowered program, to pass
them in that order. Backend half; no engine code here.
"""

from __future__ import annotations

from cudabuild.errors import CompileFailed


def delegate_call(ep, method: str):
    """The one `executorch_call_delegate` node of a lowered method's outer program."""
    calls = [n for n in ep.graph.nodes
             if n.op == "call_function" and getattr(n.target, "__name__", "") == "executorch_call_delegate"]
    if len(calls) != 1:
        raise CompileFailed(f"method {method}: expected one delegate call in the lowered program, found {len(calls)}")
    return calls[0]


def delegate_input_positions(ep, method: str) -> list[int]:
    """For each input of the method's delegate, in the delegate's order, its position among the
    method's user inputs."""
    user_inputs = list(ep.graph_signature.user_inputs)
    positions = []
    for arg in delegate_call(ep, method).args[1:]:
        name = getattr(arg, "name", None)
        if getattr(arg, "op", None) != "placeholder" or name not in user_inputs:
            raise CompileFailed(f"method {method}: the delegate takes {arg}, which is not one of the method's inputs; "
                                "expected the whole graph in one AOTI partition")
        positions.append(user_inputs.index(name))
    return positions


def _rank(positions: list[int]) -> list[int]:
    """The indices of `positions` in ascending order of position: the new order of the inputs."""
    return sorted(range(len(positions)), key=positions.__getitem__)


def reorder_user_inputs(ep, positions: list[int]):
    """Put `ep`'s user inputs in the order `positions` gives them (the i-th moves to rank
    positions[i] among them); in place, and returned. Nothing else changes: the placeholders are
    moved, the signature and the root's call signature follow."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind

    specs = list(ep.graph_signature.input_specs)
    user_slots = [i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT]
    if len(user_slots) != len(positions) or sorted(positions) != sorted(set(positions)):
        raise ValueError(f"{len(user_slots)} user inputs cannot take the positions {positions}")
    rank = _rank(positions)
    if rank == list(range(len(rank))):
        return ep
    user_specs = [specs[i] for i in user_slots]
    for slot, source in zip(user_slots, rank):
        specs[slot] = user_specs[source]

    graph = ep.graph_module.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    body = next(n for n in graph.nodes if n.op != "placeholder")
    for spec in specs:  # prepending in order before the first op lays them out in that order
        body.prepend(placeholders[spec.arg.name])
    ep._graph_signature = ExportGraphSignature(input_specs=specs, output_specs=list(ep.graph_signature.output_specs))
    for entry in ep.module_call_graph:
        if entry.fqn == "" and entry.signature is not None and len(entry.signature.inputs) == len(rank):
            entry.signature.inputs = [entry.signature.inputs[i] for i in rank]
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        if len(args) == len(rank) and not kwargs:
            ep._example_inputs = (tuple(args[i] for i in rank), kwargs)
    ep.graph_module.recompile()
    return ep


def call_delegates_in_method_order(edge_manager, methods: list[str]) -> list[str]:
    """Rewrite each method's delegate call (and the program lowered into it) so the delegate takes
    the method's inputs in the method's order; returns the methods that needed it."""
    reordered = []
    for method in methods:
        ep = edge_manager.exported_program(method)
        positions = delegate_input_positions(ep, method)
        if positions == sorted(positions):
            continue
        call = delegate_call(ep, method)
        lowered = getattr(ep.graph_module, call.args[0].target)
        reorder_user_inputs(lowered.original_module, positions)
        inputs = call.args[1:]
        call.args = (call.args[0], *(inputs[i] for i in _rank(positions)))
        ep.graph_module.recompile()
        reordered.append(method)
    return reordered

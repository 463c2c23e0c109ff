"""An exported program run eagerly on a device without its weights resident there.

Why: the reference stage runs a method's exported program eagerly on the target's device, which
verify compares the compiled code with. Moving the whole program there (torch.export's
`move_to_device_pass`) holds every weight on the device at once: at 40 layers of Qwen3.5-35B-A3B,
19 GiB of int4 experts and bf16 embeddings, and the reference peaked at 23.06 GiB (H100,
2026-12-06), more than a 24 GB card has once its CUDA context is made.

What this does instead: the program's *state* (the buffers it writes: KV caches, conv and recurrent
states; sampled_logits.program_buffers finds them) is put on the device once and stays there
across steps; every other tensor the graph reads (weights, lifted constants) stays where the store
maps it, on the host, and is copied to the device for the one op that reads it, then let go. The
device then holds the state, the activations and one op's weights at a time (a layer's experts,
about 0.45 GiB at 35b-a3b), whatever the depth. Each call of the program copies every weight once:
at 40 layers about 19 GB host-to-device a step, a second or two on a PCIe 5 link.

The values are those `move_to_device_pass` then `ep.module()` would compute: the same graph, the
same ops on the same device, the graph's burnt-in devices retargeted the same way
(lowmem.point_graph_at_device). An op that writes an argument that is not resident state would
write a copy that is thrown away: that raises StreamedWriteError rather than lose the write.

Owns the streamed interpreter. Must not touch: which buffers are state (sampled_logits), what is
compared (verify).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import weakref

import torch
import torch.utils._pytree as pytree

from cudabuild.errors import CudabuildError


class StreamedWriteError(CudabuildError):
    """An op of the program writes a tensor that is streamed (not resident state)."""


class StreamedProgram:
    """`ep`'s module on `device`, its `resident` buffers (by FQN) moved there for good and every
    other tensor it reads copied there per op (the module docstring). On the CPU nothing moves."""

    def __init__(self, ep, device: str, resident: Iterable[str] = (), *, copy_on_cpu: bool = False):
        from cudabuild.backend.lowmem import point_graph_at_device

        self.device = torch.device(device)
        self.gm = ep.module()  # its parameters and buffers are the program's own tensors, not copies
        # The graph's own writes are resident whatever `resident` says: a write lands in the tensor
        # the module holds, never in a copy (a program's signature may name only part of its state).
        writes = {root.target for root in written_roots(self.gm.graph) if root.op == "get_attr"}
        self.resident = sorted(set(resident) | writes)
        if self.device.type != "cpu":
            point_graph_at_device(self.gm, self.device)
            for fqn in self.resident:
                owner, _, name = fqn.rpartition(".")
                module = self.gm.get_submodule(owner) if owner else self.gm
                moved = getattr(module, name).to(self.device)
                if name in module._buffers:
                    module.register_buffer(name, moved, persistent=name not in module._non_persistent_buffers_set)
                else:  # a lifted constant the graph writes: a plain attribute of the module
                    setattr(module, name, moved)
        # What is streamed: every tensor the module holds but the resident state. On the CPU the
        # tensors are already where the ops run; `copy_on_cpu` copies them per op anyway, which is
        # how the CPU tests watch the streaming (what is copied, and how much of it is alive at once).
        held = dict(self.gm.named_parameters(remove_duplicate=False))
        held.update(self.gm.named_buffers(remove_duplicate=False))
        resident = set(self.resident)
        self.streamed = {id(t): t for fqn, t in held.items() if fqn not in resident}
        self.copies = self.device.type != "cpu" or copy_on_cpu
        self.copied_bytes = 0  # host-to-device bytes of streamed tensors, over every call
        self.largest_op_bytes = 0  # the most one op had copied for it
        self.peak_live_bytes = 0  # the most bytes of copies alive at once (on the device: the cost in memory)
        self._live: list[tuple[weakref.ref, int]] = []

    def _note_copy(self, copy: torch.Tensor, nbytes: int) -> None:
        self._live = [(ref, n) for ref, n in self._live if ref() is not None]
        self._live.append((weakref.ref(copy), nbytes))
        self.copied_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, sum(n for _, n in self._live))

    def run(self, args: tuple, capture: Optional[torch.fx.Node] = None) -> tuple[Any, Optional[torch.Tensor]]:
        """The program's output for `args` (moved to the device), and the value of node `capture`
        (detached, float, on the CPU) where one is named."""
        interpreter = _Streaming(self, capture)
        with torch.no_grad():
            out = interpreter.run(*[a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args])
        return out, interpreter.captured

    def buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named buffers' values now, on the CPU."""
        held = dict(self.gm.named_buffers())
        return {fqn: held[fqn].detach().cpu() for fqn in names if fqn in held}


def written_roots(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose tensors the graph writes in place: where an op's schema says it writes an
    argument (`Tensor(a!)`), the node that argument is, or is a chain of views of (a view's schema
    aliases its result to its first argument): a placeholder or a get_attr for a program's state."""
    roots = set()
    for node in graph.nodes:
        for _, arg in _written_arguments(node, node.args, node.kwargs):
            root = _viewed(arg)
            if root is not None:
                roots.add(root)
    return roots


def _written_arguments(node: torch.fx.Node, args: tuple, kwargs: dict):
    """(name, value) of each argument `node`'s op writes (its schema's `Tensor(a!)`), a list's
    elements one by one, as they stand in `args` and `kwargs` (the node's own, or their values)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        for element in value if isinstance(value, (list, tuple)) else [value]:
            yield argument.name, element


def _viewed(node):
    """The node a chain of views starts from."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or not node.args:
            break
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) else None


def _storage_bytes(t: torch.Tensor) -> int:
    """The bytes a copy of `t` moves: its storage's, or for a wrapper subclass (no storage of its
    own), its inner tensors'."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        return sum(_storage_bytes(getattr(t, name)) for name in flatten()[0])
    return t.untyped_storage().nbytes() if t.numel() else 0


class _Streaming(torch.fx.Interpreter):
    def __init__(self, program: StreamedProgram, capture: Optional[torch.fx.Node]):
        super().__init__(program.gm)
        self.program, self.capture, self.captured = program, capture, None

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            out = super().run_node(n)  # placeholders, outputs, get_attr: a get_attr stays where it is
        else:
            with self._set_current_node(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                copies: dict[int, int] = {}  # id of each copy made for this op -> its bytes
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self._here(t, copies), (args, kwargs))
                if copies:
                    self.program.largest_op_bytes = max(self.program.largest_op_bytes, sum(copies.values()))
                    self._refuse_streamed_writes(n, args, kwargs, copies)
                out = getattr(self, n.op)(n.target, args, kwargs)
        if n is self.capture:
            self.captured = out.detach().float().cpu()
        return out

    def _here(self, t: torch.Tensor, copies: dict[int, int]) -> torch.Tensor:
        program = self.program
        if id(t) not in program.streamed and t.device == program.device:
            return t  # an activation, or resident state
        if not program.copies:
            return t
        # A quantized weight is a tensor subclass (torchao's), whose `to` takes no `copy=`: a move
        # to another device copies anyway, and a forced copy on the CPU is a clone.
        copy = t.to(program.device) if t.device != program.device else t.clone()
        nbytes = _storage_bytes(t)
        copies[id(copy)] = nbytes
        program._note_copy(copy, nbytes)
        return copy

    @staticmethod
    def _refuse_streamed_writes(n: torch.fx.Node, args: tuple, kwargs: dict, copies: dict[int, int]) -> None:
        for name, value in _written_arguments(n, args, kwargs):
            if isinstance(value, torch.Tensor) and id(value) in copies:
                raise StreamedWriteError(
                    f"{n.target} writes its argument {name!r}",
                    "it is not among the program's state buffers, so the write would be lost",
                    fix="the op writes it without its schema saying so (Tensor(a!)), which is how the state is found")

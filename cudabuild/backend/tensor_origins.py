"""Where each tensor of a lowered program came from, and the lowered program for other weights.

The edge lowering (ExecuTorch's to_edge_transform_and_lower and the CUDA backend's passes) is
handed an exported program and gives back another. Its tensors are either the exported program's,
handed on (the very tensor, a view of its storage, or a copy of it: ExecuTorch deep-copies the
program's non-persistent buffers, the KV caches), or the lowering's own (the scalars its passes
lift into tensors). What a lowering *computes*, its graph and its own tensors, depends on the
exported program's structure alone unless it reads a weight's values; and that is what `watched`
tells: while the lowering runs, a dispatch mode notes every aten op that takes one of the exported
program's tensors (or a copy of one) as an argument, other than ops that only view it, ask its
size or allocate alike (`new_empty`). Copies are noted as where a new storage came from, not as
reads: a `copy_` of one whole storage into another (how `copy.deepcopy` copies a tensor: its
storage as bytes), and a `clone` or same-dtype `_to_copy` of a whole tensor (the values, in the
copy's own layout).

So when a lowering read nothing (`Watch.reads` empty; on the CPU for both recipes, every edge run
is checked), its result is a function of the exported program's code (programs.code_digest), and
the lowered program for *other* weights of the same code is its graph and own tensors with each
handed-on tensor taken from the new exported program instead (`for_weights`, on tensors by FQN;
`put` puts them in a program): the edge stage need not run again for new weights, and what it
would have produced is built in a second.

Not seen by the mode: reads that bypass torch's dispatcher (a tensor's `.numpy()`, its raw data
pointer). A wrapper subclass (torchao's quantized weights) is followed by its identity and by its
inner tensors' storages (handed on unwrapped, an inner tensor's origin is `FQN:inner`); a new
wrapper object around them cannot be followed, and the edge stage then treats the lowering as one
that read the weights.
This module imports torch; it is used by stages only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from cudabuild.backend.programs import program_tensors

# Ops that read no values of their tensor arguments: views, metadata, allocation alike.
_NO_READ = frozenset({
    "alias", "as_strided", "detach", "diagonal", "expand", "lift_fresh", "narrow", "permute", "select", "slice",
    "split", "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unfold", "unsqueeze", "view", "_unsafe_view",
    "_reshape_alias", "view_as_real", "view_as_complex", "chunk", "reshape", "flatten", "movedim",
    "new_empty", "new_empty_strided", "empty_like", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like",
    "full_like", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "is_contiguous",
    "_has_compatible_shallow_copy_type", "set_",
})
_SHOWN = 3  # reads kept to say why


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and t.numel() > 0


def _ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _meta(t) -> list:
    return [str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()), int(t.storage_offset())]


@dataclass
class Watch:
    """What a lowering did with the exported program's tensors (see the module docstring)."""

    # storage data_ptr -> (name, tensor): the exported tensors by FQN, and the inner tensors of
    # wrapper subclasses (torchao's) as `FQN:inner`
    storages: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)  # id(tensor) -> fqn, for wrapper subclasses
    # storage data_ptr of a copy -> (fqn copied, "storage": its storage's bytes | "values": its values)
    copies: dict = field(default_factory=dict)
    reads: list = field(default_factory=list)  # "op on fqn", the first few
    read_count: int = 0

    def source(self, t) -> Optional[str]:
        """The exported tensor whose values `t` holds (its storage, or a copy of it), if any."""
        if is_traceable_wrapper_subclass(t):
            return self.objects.get(id(t))
        if not _plain(t):
            return None
        ptr = _ptr(t)
        held = self.storages.get(ptr)
        return held[0] if held is not None else (self.copies[ptr][0] if ptr in self.copies else None)

    def whole(self, t) -> Optional[str]:
        """The exported tensor `t` is exactly (same storage and view), or a copy of its values."""
        if not _plain(t):
            return None
        ptr = _ptr(t)
        held = self.storages.get(ptr)
        if held is not None:
            return held[0] if _meta(held[1]) == _meta(t) else None
        copied = self.copies.get(ptr)
        return copied[0] if copied is not None and copied[1] == "values" else None

    def whole_storage(self, t) -> Optional[str]:
        """The exported tensor whose whole storage `t` spans, byte for byte (or a storage copy of it)."""
        if not _plain(t) or t.storage_offset() != 0 or not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        if t.numel() * t.element_size() != storage.nbytes():
            return None
        ptr = storage.data_ptr()
        if ptr in self.storages:
            return self.storages[ptr][0]
        copied = self.copies.get(ptr)
        return copied[0] if copied is not None and copied[1] == "storage" else None

    def noted(self, op: str, fqn: str) -> None:
        self.read_count += 1
        if len(self.reads) < _SHOWN:
            self.reads.append(f"{op} on {fqn}")


class _Mode(TorchDispatchMode):
    def __init__(self, watch: Watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _NO_READ:
            return func(*args, **kwargs)
        watch = self.watch
        if name == "copy_" and watch.source(args[0]) is None:
            copied = watch.whole_storage(args[1])
            if copied is not None and _plain(args[0]) and args[0].storage_offset() == 0 and args[0].is_contiguous() \
                    and args[0].numel() * args[0].element_size() == args[0].untyped_storage().nbytes() == \
                    args[1].untyped_storage().nbytes():
                out = func(*args, **kwargs)
                watch.copies[_ptr(args[0])] = (copied, "storage")
                return out
        if name in ("clone", "_to_copy"):
            copied = watch.whole(args[0])
            if copied is not None:
                out = func(*args, **kwargs)
                if _plain(out) and out.dtype == args[0].dtype and list(out.shape) == list(args[0].shape) \
                        and out.device == args[0].device:
                    watch.copies[_ptr(out)] = (copied, "values")
                    return out
                watch.noted(str(func), copied)
                return out
        for arg in _tensor_args(args, kwargs):
            fqn = watch.source(arg)
            if fqn is not None:
                watch.noted(str(func), fqn)
                break
        return func(*args, **kwargs)


def _tensor_args(args, kwargs) -> Iterator:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def watched(ep) -> Iterator[Watch]:
    """Within the block, what is done with `ep`'s tensors is noted in the Watch yielded."""
    watch = Watch()
    for fqn, t in program_tensors(ep).items():
        if is_traceable_wrapper_subclass(t):
            watch.objects[id(t)] = fqn
            names, _ = t.__tensor_flatten__()
            for name in names:  # a read of an inner tensor reads the weight
                inner = getattr(t, name)
                if _plain(inner):
                    watch.storages.setdefault(_ptr(inner), (f"{fqn}:{name}", inner))
        elif _plain(t):
            watch.storages.setdefault(_ptr(t), (fqn, t))
    with _Mode(watch):
        yield watch


def origins(watch: Watch, lowered) -> tuple[dict, list[str]]:
    """{fqn: where its values come from} for the lowered program's tensors that come from the
    exported program (the rest are the lowering's own), and the tensors whose origin cannot be
    told (wrapper subclasses that are not the exported program's own objects).

    An origin is {"from": exported fqn (`fqn:inner` for an inner tensor of a wrapper subclass),
    "as": "same" | "view" | "storage copy" | "copy", "meta":
    [dtype, shape, stride, storage offset]}: the tensor itself, a view of its storage, a view of a
    copy of its storage, or a copy of its values.
    """
    found, unknown = {}, []
    for fqn, t in program_tensors(lowered).items():
        if is_traceable_wrapper_subclass(t):
            if id(t) in watch.objects:
                found[fqn] = {"from": watch.objects[id(t)], "as": "same", "meta": None}
            else:
                unknown.append(fqn)
            continue
        if not _plain(t):
            continue
        ptr = _ptr(t)
        if ptr in watch.storages:
            source, held = watch.storages[ptr]
            same = _meta(held) == _meta(t)
            found[fqn] = {"from": source, "as": "same" if same else "view", "meta": None if same else _meta(t)}
        elif ptr in watch.copies:
            source, kind = watch.copies[ptr]
            found[fqn] = {"from": source, "as": "storage copy" if kind == "storage" else "copy", "meta": _meta(t)}
    return found, unknown


def for_weights(lowered: dict, tensor_origins: dict, exported: dict) -> dict:
    """The lowered program's tensors (`lowered`, by FQN) as the lowering would have made them from
    `exported`'s (by FQN), a program of the same code: each tensor `tensor_origins` (origins'
    result) says came from the exported program taken from `exported` instead."""
    out = dict(lowered)
    for fqn, origin in tensor_origins.items():
        name, _, inner = origin["from"].partition(":")  # an inner tensor of a wrapper subclass: FQN:inner
        new = getattr(exported[name], inner) if inner else exported[name]
        if origin["as"] in ("view", "storage copy"):
            dtype, shape, stride, offset = origin["meta"]
            storage = new.untyped_storage()
            storage = storage.clone() if origin["as"] == "storage copy" else storage
            new = torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, shape, stride)
        elif origin["as"] == "copy":
            dtype, shape, stride, _ = origin["meta"]
            new = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype)).copy_(new)
        out[fqn] = new
    return out


def put(program, tensors: dict) -> None:
    """Put `tensors` (by FQN) in `program`'s state dict and constants, in place of its own."""
    for fqn, new in tensors.items():
        table = program.state_dict if fqn in program.state_dict else program.constants
        if fqn not in table:
            continue
        if isinstance(table[fqn], torch.nn.Parameter) and not isinstance(new, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=False)
        table[fqn] = new

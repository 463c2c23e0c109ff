"""ExportedPrograms as stored artifacts, and their canonical graph hash.

A program is stored as separate files so that identical parts are stored once, across methods
and across stages: `program.json` (the graph, through ExecuTorch's serde, which also handles
edge-dialect ops), one `tensor.<fqn>` file per weight with `weights.json` indexing them (decode
and prefill share every weight file; the edge program shares all but the few tensors its passes
create), `constants.pt` (lifted constants and non-persistent buffers such as the KV cache) and
`inputs.pt` (example inputs).

`graph_digest` is what downstream keys use instead of those bytes: the graph's structure (op
targets, argument wiring by position, shapes, dtypes, symbolic ranges), its signature, and a
content digest of every weight and constant, with node names and stack traces left out. Two
exports of the same model give the same digest whatever file or line the code came from.

`code_digest` is the same summary with the *values* of the weights left out: each tensor by its
name, dtype, shape, strides, storage offset and size, and device only. It is what decides the
compiled code (cudabuild.backend.stages.compile), so new weights for the same model keep it. The
exception is a tensor whose value can decide code (`decides_code`): one of at most one element,
which inductor writes into a kernel as a literal (a 0-d constant) or folds (a one-element constant
in `constant_fold_uniform_value`); those keep their content digest in it. (Inductor also inlines
1-D constants of up to 8 elements; the compile stage turns that off, so a small weight such as
qwen_moe tiny's `A_log` or `dt_bias`, 4 values each, stays a constant of the weights blob:
cudabuild.backend.stages.compile.) A tensor the caller names as its own (`own`: one a lowering
made itself, not a weight it was handed) keeps its value in the code digest too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from cudabuild.engine.hashing import sha256_file
from cudabuild.engine.spans import SpanReader

TENSOR_PREFIX = "tensor."


@dataclass
class StoredWeights:
    """Weights already in the store, by the storage that holds them in this process.

    A program loaded from the store maps its weights from the stored files (`load_program`), and a
    stage that hands such a tensor on unchanged (edge passes do not touch weights) need not write
    or hash its gigabytes again: `save_program` names the stored file instead. An entry holds the
    tensor itself, so its memory cannot be freed and reused by another tensor while the entry lives.
    """

    entries: dict = field(default_factory=dict)  # storage data_ptr -> (tensor, sha256 of its file)

    def add(self, tensor: torch.Tensor, sha: str) -> None:
        if tensor.numel() and not _is_subclass(tensor):
            self.entries[tensor.untyped_storage().data_ptr()] = (tensor, sha)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t, _ in self.entries.values()]

    def sha_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The stored file of exactly this tensor (same storage, view, dtype and type), or None."""
        if not tensor.numel() or _is_subclass(tensor):
            return None
        entry = self.entries.get(tensor.untyped_storage().data_ptr())
        if entry is None:
            return None
        held, sha = entry
        same = (type(held) is type(tensor) and held.dtype == tensor.dtype and held.shape == tensor.shape
                and held.stride() == tensor.stride() and held.storage_offset() == tensor.storage_offset()
                and held.untyped_storage().nbytes() == tensor.untyped_storage().nbytes())
        return sha if same else None

    @contextlib.contextmanager
    def shared_when_copied(self) -> Iterator[None]:
        """Within the block, `copy.deepcopy` of a tensor held here gives the tensor itself.

        ExecuTorch's edge lowering deep-copies the whole program before its passes, weights
        included: for a real checkpoint that is a second copy of every weight in memory. The
        weights held here are mapped read-only from the store and never written (a stage that
        changes a weight makes a new tensor), so a copy that shares them is the same value.
        """
        held = {id(t) for t, _ in self.entries.values()}
        classes = (torch.Tensor, torch.nn.Parameter)
        saved = {cls: cls.__dict__["__deepcopy__"] for cls in classes}

        def sharing(original):
            def __deepcopy__(tensor, memo):
                if id(tensor) in held:
                    memo[id(tensor)] = tensor
                    return tensor
                return original(tensor, memo)

            return __deepcopy__

        for cls in classes:
            cls.__deepcopy__ = sharing(saved[cls])
        try:
            yield
        finally:
            for cls in classes:
                cls.__deepcopy__ = saved[cls]


@dataclass
class SavedProgram:
    """What save_program wrote: `files` (name -> path, new now), `shas` (name -> sha256 of every
    part, written or reused), `reused` (name -> sha256 of parts already stored, not written) and
    `index` (weight fqn -> its part's name)."""

    files: dict[str, Path]
    shas: dict[str, str]
    reused: dict[str, str]
    index: dict[str, str]
    regions: dict[str, list] = field(default_factory=dict)  # tensor file -> its storages' (offset, length)

    @property
    def weights(self) -> dict[str, str]:
        """fqn -> the sha256 of its tensor file: what graph_summary keys the weights on."""
        return {fqn: self.shas[name] for fqn, name in self.index.items()}


def save_program(ep, folder: Path, reuse: Optional[StoredWeights] = None,
                 keep: Optional[Callable[[Path, str, list], str]] = None) -> SavedProgram:
    """Write the program's parts into `folder`, one weight at a time, straight to its file (a
    program of tens of GB is never held twice); a weight `reuse` knows is named, not written.
    With `keep(path, sha, regions)` (a stage's StageContext.keep), each weight file is stored as
    soon as it is written and gone from `folder`, so a program's weights never lie in the folder
    all at once (at 40 layers of a 35B MoE, 20 GB a method); it is then among `reused`."""
    from executorch.exir.serde.serialize import serialize

    saved = save_weights(ep.state_dict, folder, reuse, keep)
    # serialize() would copy every weight into its own bytes; it only needs the graph, so it gets a
    # program whose state dict is empty (the weights are written above).
    with _symbolic_ops_serializable():
        artifact = serialize(_without_state(ep))
    parts = {"program.json": artifact.exported_program, "constants.pt": artifact.constants,
             "inputs.pt": artifact.example_inputs, "weights.json": json.dumps(saved.index, sort_keys=True).encode()}
    for name, data in parts.items():
        saved.files[name] = folder / name
        saved.files[name].write_bytes(data)
        saved.shas[name] = hashlib.sha256(data).hexdigest()
    return saved


def save_weights(state: dict, folder: Path, reuse: Optional[StoredWeights] = None,
                 keep: Optional[Callable[[Path, str, list], str]] = None) -> SavedProgram:
    """A program's weights (`state`: its state dict, by FQN) written as save_program writes them,
    one `tensor.<fqn>` file each (the same bytes for the same tensor, whoever writes it); with
    `reuse` and `keep` as there. The weights alone: what binding new weights into a stored
    program writes (cudabuild.backend.stages.export)."""
    folder.mkdir(parents=True, exist_ok=True)
    files, shas, reused, index, regions = {}, {}, {}, {}, {}
    for fqn, tensor in state.items():
        name = index[fqn] = TENSOR_PREFIX + fqn
        known = reuse.sha_of(tensor) if reuse is not None else None
        if known is not None:
            shas[name] = reused[name] = known
            continue
        path = folder / name
        torch.save(tensor, path)
        shas[name] = sha256_file(path)
        if keep is not None:
            reused[name] = keep(path, shas[name], archive_regions(path))
        else:
            files[name] = path
            regions[name] = archive_regions(path)
        if reuse is not None:
            reuse.add(tensor, shas[name])
    return SavedProgram(files, shas, reused, index, regions)


def _without_state(ep):
    """A shallow copy of `ep` whose state dict is empty (the graph and signature are shared)."""
    import copy

    bare = copy.copy(ep)
    bare._state_dict = {}
    return bare


def archive_regions(path: Path) -> list[tuple[int, int]]:
    """[(offset, length)] of each storage's bytes in a torch.save archive (a zip whose members are
    stored, not compressed): the regions by which the store finds them in other files."""
    import zipfile

    regions = []
    with open(path, "rb") as raw, zipfile.ZipFile(raw) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename and info.compress_type == zipfile.ZIP_STORED and info.file_size:
                regions.append((_member_offset(raw, info), info.file_size))
    return regions


def _member_offset(raw, info) -> int:
    """Where a stored zip member's bytes start: after its local header (30 bytes, the name, the extra field)."""
    import struct

    raw.seek(info.header_offset + 26)
    name_length, extra_length = struct.unpack("<HH", raw.read(4))
    return info.header_offset + 30 + name_length + extra_length


def _load_mapped_archive(manifest: dict, paths: dict):
    """torch.load of a torch.save archive kept as spans: the small members (the pickle) read, each
    storage mapped (copy-on-write) from the file that holds its bytes, so a weight of gigabytes is
    neither read nor written out here; the restricted unpickler torch.load(weights_only=True) uses."""
    import zipfile

    import numpy as np
    from torch import _weights_only_unpickler

    span_file = SpanReader(manifest, lambda sha: open(paths[sha], "rb"))
    with span_file, zipfile.ZipFile(span_file) as archive:
        prefix = archive.namelist()[0].split("/")[0]

        def storage(key: str, nbytes: int) -> torch.UntypedStorage:
            info = archive.getinfo(f"{prefix}/data/{key}")
            offset = _member_offset(span_file, info)
            index, inner = span_file.where(offset)
            kind, source, start, length = span_file.parts[index]
            if nbytes and kind == "blob" and inner + nbytes <= length:
                mapped = np.memmap(paths[source], dtype=np.uint8, mode="c", offset=start + inner, shape=(nbytes,))
                return torch.from_numpy(mapped).untyped_storage()
            data = archive.read(info)[:nbytes]  # a small tensor, or one the glue holds: read
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage() if data else torch.UntypedStorage(0)

        def persistent_load(saved_id):
            _, storage_type, key, _, numel = saved_id
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            nbytes = numel * torch._utils._element_size(dtype)
            return torch.storage.TypedStorage(wrap_storage=storage(str(key), nbytes), dtype=dtype, _internal=True)

        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl")), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        return unpickler.load()


def _load_state(read: Callable[[str], Union[bytes, Path]], reuse: Optional[StoredWeights], skip=frozenset()) -> dict:
    """The stored program's weights by FQN (but those in `skip`, whose files are not even asked
    for): each mapped from its file where `read` gives a path, or from the files its bytes lie in
    where the store keeps it as ranges of them (`read.mapped`)."""
    index = json.loads(_data(read, "weights.json"))
    mapped = getattr(read, "mapped", None)
    state = {}
    for fqn, name in index.items():
        if fqn in skip:
            continue
        view = mapped(name) if mapped is not None else None
        if view is not None:
            state[fqn] = _load_mapped_archive(*view)
        else:
            part = read(name)
            if isinstance(part, bytes):
                state[fqn] = torch.load(io.BytesIO(part), weights_only=True)
                continue
            state[fqn] = torch.load(part, weights_only=True, mmap=True)
        sha = getattr(read, "sha", None)
        if reuse is not None and sha is not None:
            reuse.add(state[fqn], sha(name))
    return state


def _data(read: Callable[[str], Union[bytes, Path]], name: str) -> bytes:
    part = read(name)
    return part if isinstance(part, bytes) else Path(part).read_bytes()


def load_program(read: Callable[[str], Union[bytes, Path]], reuse: Optional[StoredWeights] = None):
    """Rebuild an ExportedProgram; `read(name)` gives one stored part: its bytes, or the path of a
    verified file, whose weights are then memory-mapped rather than read (and recorded in `reuse`
    with the file's sha256, which `read` names as `read.sha(name)` when it can)."""
    from executorch.exir.serde.export_serialize import SerializedArtifact
    from executorch.exir.serde.serialize import deserialize

    state = _load_state(read, reuse)
    with _symbolic_ops_serializable():
        return deserialize(SerializedArtifact(_data(read, "program.json"), state, _data(read, "constants.pt"),
                                              _data(read, "inputs.pt")))


def load_tensors(read: Callable[[str], Union[bytes, Path]], reuse: Optional[StoredWeights] = None,
                 skip=frozenset()) -> dict:
    """A stored program's tensors by FQN, as `program_tensors(load_program(read))` has them, without
    its graph (whose deserialisation is most of a big program's load): weights mapped, and the
    weights named in `skip` left out (their files not read, nor fetched from a shared tier)."""
    from torch._export.serde.serialize import deserialize_torch_artifact

    tensors = _load_state(read, reuse, skip)
    constants = deserialize_torch_artifact(_data(read, "constants.pt"))
    tensors.update((fqn, t) for fqn, t in constants.items() if isinstance(t, torch.Tensor))
    return tensors


# Size arithmetic torch's own serializer writes and ExecuTorch 1.4.1's copy of it does not know: a
# dynamic length sliced from the end (`x[..., -T:]`, as ExecuTorch's Qwen3.5-MoE prefill does)
# leaves `operator.neg` of a size in the graph. Its inputs and output are a SymInt like the other
# unary ops the serializer handles (sym_int, sym_sqrt), so it is serialized the same way.
_MISSING_SYM_INT_OPS = (operator.neg,)


@contextlib.contextmanager
def _symbolic_ops_serializable() -> Iterator[None]:
    from executorch.exir.serde import export_serialize

    known = export_serialize._SYM_INT_OPS
    added = [op for op in _MISSING_SYM_INT_OPS if op not in known]
    known.update(added)
    try:
        yield
    finally:
        known.difference_update(added)


def load_example_inputs(data: bytes) -> tuple:
    """The example inputs stored with a program (a (args, kwargs) pair, as torch.export keeps them)."""
    from torch._export.serde.serialize import deserialize_torch_artifact

    args, kwargs = deserialize_torch_artifact(data)
    return tuple(args)


# -- canonical graph hash -----------------------------------------------------------------------


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # "aten.mm.default"
    if type(target).__name__ == "EdgeOpOverload":  # edge-dialect ops wrap an aten OpOverload
        return "edge:" + str(target._op)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "hop:" + target.name()
    module = getattr(target, "__module__", "") or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{qual}" if qual else _stable_repr(target)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable_repr(value: Any) -> str:
    """repr without memory addresses, which differ from one process to the next."""
    return _ADDRESS.sub("", f"{type(value).__name__}:{value}")


def _canon(value: Any, index: dict) -> Any:
    if isinstance(value, torch.fx.Node):
        return ["%", index[value]]
    if isinstance(value, (list, tuple)):
        return [_canon(v, index) for v in value]
    if isinstance(value, dict):
        return {str(k): _canon(v, index) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_meta(value)
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "sym:" + str(value)
    return _stable_repr(value)


def _tensor_meta(t: torch.Tensor) -> list:
    return ["T", str(t.dtype), [str(s) for s in t.shape], [str(s) for s in t.stride()], str(t.device.type)]


def node_lines(gm: torch.fx.GraphModule) -> list[str]:
    """One canonical line per node, in graph order (what explain diffs between two builds)."""
    index: dict = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        val = node.meta.get("val")
        entry = [node.op, _target_name(node.target) if node.op != "placeholder" else "",
                 _canon(node.args, index), _canon(node.kwargs, index), _canon(val, index)]
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                entry.append(node_lines(sub))
        lines.append(json.dumps(entry, sort_keys=True, separators=(",", ":"), default=str))
    return lines


def _is_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass that wraps plain tensors (torchao's quantized weights): it has no storage
    of its own to map or share, and its bytes are those of its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    if _is_subclass(t):
        # Its type, what it was flattened with (block sizes, dtypes) and each inner tensor's digest.
        names, meta = t.__tensor_flatten__()
        h.update(f"{type(t).__module__}.{type(t).__qualname__}{t.dtype}{list(t.shape)}{_stable_repr(meta)}".encode())
        for name in names:
            h.update(f"{name}:{tensor_digest(getattr(t, name))}".encode())
        return h.hexdigest()
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{list(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def graph_summary(ep, weights: Optional[dict[str, str]] = None) -> dict:
    """The canonical summary graph_digest hashes. `weights` (fqn -> sha256 of the stored tensor
    file, from save_program) keys the weights without reading them again; else they are hashed."""
    sig = ep.graph_signature
    return {
        "nodes": node_lines(ep.graph_module),
        "inputs": [[str(s.kind), s.target] for s in sig.input_specs],
        "outputs": [[str(s.kind), s.target] for s in sig.output_specs],
        "ranges": sorted(f"{k}:{v}" for k, v in ep.range_constraints.items()),
        "state": {k: (weights[k] if weights is not None else tensor_digest(v)) for k, v in sorted(ep.state_dict.items())},
        "constants": {k: tensor_digest(v) for k, v in sorted(ep.constants.items()) if isinstance(v, torch.Tensor)},
    }


def decides_code(t: torch.Tensor) -> bool:
    """Whether inductor may read this constant's value while compiling (see the module docstring);
    for a wrapper subclass, whether any of its inner tensors (what the compile sees) may be read."""
    if _is_subclass(t):
        names, _ = t.__tensor_flatten__()
        return any(decides_code(getattr(t, name)) for name in names)
    return t.numel() <= 1


def tensor_code(t: torch.Tensor) -> list:
    """What of a tensor the compiled code depends on, its values aside: dtype, shape, strides,
    storage offset and bytes (the weights blob holds each constant's whole storage), and device;
    for a wrapper subclass (torchao's quantized weights) its type, what it was flattened with and
    each inner tensor's."""
    if _is_subclass(t):
        names, meta = t.__tensor_flatten__()
        return ["S", f"{type(t).__module__}.{type(t).__qualname__}", str(t.dtype), [str(s) for s in t.shape],
                _stable_repr(meta), {name: tensor_code(getattr(t, name)) for name in names}]
    nbytes = t.untyped_storage().nbytes() if t.numel() else 0
    return ["T", str(t.dtype), [str(s) for s in t.shape], [str(s) for s in t.stride()], int(t.storage_offset()),
            nbytes, str(t.device.type)]


def program_tensors(ep) -> dict:
    """Every tensor of a program by FQN: its weights and persistent buffers (state) and its tensor
    constants (lifted constants, non-persistent buffers such as KV caches)."""
    tensors = dict(ep.state_dict)
    tensors.update((fqn, t) for fqn, t in ep.constants.items() if isinstance(t, torch.Tensor))
    return tensors


def code_summary(ep, summary: dict, own: Optional[set] = None) -> dict:
    """`summary` (graph_summary's) with the weights' values left out (see the module docstring):
    what code_digest hashes. `own` names the tensors whose values stay in (None: none)."""
    return tensors_code_summary(program_tensors(ep), summary, own)


def tensors_code_summary(tensors: dict, summary: dict, own: Optional[set] = None) -> dict:
    """code_summary of a program whose tensors by FQN (program_tensors') are `tensors`: for a
    program that is not at hand as one (a stored graph with other weights bound to it)."""
    values = {**summary["state"], **summary["constants"]}
    kept = {fqn for fqn, t in tensors.items() if decides_code(t) or (own is not None and fqn in own)}
    return {
        "nodes": summary["nodes"], "inputs": summary["inputs"], "outputs": summary["outputs"],
        "ranges": summary["ranges"],
        "tensors": {fqn: tensor_code(t) for fqn, t in sorted(tensors.items())},
        "values": {fqn: values.get(fqn) or tensor_digest(tensors[fqn]) for fqn in sorted(kept)},
    }


def weight_layout(t: torch.Tensor) -> list:
    """What of a weight must be the same for another weight to take its place in a stored program:
    its code (tensor_code: dtype, shape, strides, offset, bytes, device, a subclass's structure),
    its class (a Parameter is pickled as one) and whether it requires grad (which a Parameter's
    pickle holds too)."""
    return [*tensor_code(t), f"{type(t).__module__}.{type(t).__qualname__}", bool(t.requires_grad)]


def code_digest(ep, summary: dict, own: Optional[set] = None) -> str:
    """The digest of `ep`'s code (code_summary), given its graph_summary."""
    return graph_digest(code_summary(ep, summary, own))


def graph_digest(summary: dict) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_summary(summary: dict, path: Path) -> Path:
    path.write_text(json.dumps(summary, sort_keys=True, indent=0))
    return path

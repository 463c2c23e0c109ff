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
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

TENSOR_PREFIX = "tensor."


def save_program(ep, folder: Path) -> dict[str, Path]:
    from executorch.exir.serde.serialize import serialize

    artifact = serialize(ep)
    parts = {"program.json": artifact.exported_program, "constants.pt": artifact.constants,
             "inputs.pt": artifact.example_inputs}
    index = {}
    for fqn, tensor in ep.state_dict.items():
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        index[fqn] = TENSOR_PREFIX + fqn
        parts[index[fqn]] = buffer.getvalue()
    parts["weights.json"] = json.dumps(index, sort_keys=True).encode()
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, data in parts.items():
        files[name] = folder / name
        files[name].write_bytes(data)
    return files


def load_program(read: Callable[[str], bytes]):
    """Rebuild an ExportedProgram; `read(name)` returns the bytes of one stored file."""
    from executorch.exir.serde.export_serialize import SerializedArtifact
    from executorch.exir.serde.serialize import deserialize

    index = json.loads(read("weights.json"))
    # The deserializer takes the state dict as tensors too: no second serialized copy in memory.
    state = {fqn: torch.load(io.BytesIO(read(name)), weights_only=True) for fqn, name in index.items()}
    return deserialize(SerializedArtifact(read("program.json"), state, read("constants.pt"), read("inputs.pt")))


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


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256()
    h.update(f"{t.dtype}{list(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def graph_summary(ep) -> dict:
    sig = ep.graph_signature
    return {
        "nodes": node_lines(ep.graph_module),
        "inputs": [[str(s.kind), s.target] for s in sig.input_specs],
        "outputs": [[str(s.kind), s.target] for s in sig.output_specs],
        "ranges": sorted(f"{k}:{v}" for k, v in ep.range_constraints.items()),
        "state": {k: tensor_digest(v) for k, v in sorted(ep.state_dict.items())},
        "constants": {k: tensor_digest(v) for k, v in sorted(ep.constants.items()) if isinstance(v, torch.Tensor)},
    }


def graph_digest(summary: dict) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_summary(summary: dict, path: Path) -> Path:
    path.write_text(json.dumps(summary, sort_keys=True, indent=0))
    return path

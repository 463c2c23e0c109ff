"""Hugging Face checkpoints' files, for tests and benchmarks: config.json plus *.safetensors, one
file or shards with an index.

Owns a writer of the format (an 8-byte little-endian header length, a JSON header {name: {dtype,
shape, data_offsets}} with an optional `__metadata__`, then the raw bytes) and of a checkpoint
directory, and the reading of one file through the `safetensors` library with a header check that
names what is wrong with a file the library refuses. Must not touch: a model, a build. Nothing in
the package uses it: a build reads a checkpoint through ExecuTorch's loader (cudabuild/models/
qwen35_moe_weights.py `weight_parts`) and its headers through cudabuild/formats/safetensors_parts.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from cudabuild.errors import CudabuildError
from cudabuild.engine.files import atomic_write
from cudabuild.formats.safetensors_parts import HeaderError, checked_header, read_raw_header

PathLike = Union[str, os.PathLike]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CheckpointError(CudabuildError):
    """A checkpoint that cannot fill the model: the message names the tensor and the file."""


# ---------------------------------------------------------------------------------------------
# The safetensors format


@dataclass(frozen=True)
class Header:
    path: Path
    entries: dict  # name -> {"dtype", "shape", "data_offsets"}
    data_start: int  # file offset of the first data byte
    metadata: dict


def read_header(path: PathLike) -> Header:
    """The parsed header of one .safetensors file, checked against the file's size and the
    dtypes' sizes (safetensors_parts.checked_header; reading tensors is the library's, via `open_file`)."""
    path = Path(path)
    try:
        entries, metadata = checked_header(path)
        data_start = read_raw_header(path)[1]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (listed by the checkpoint)") from None
    except HeaderError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return Header(path, entries, data_start, metadata)


@contextlib.contextmanager
def open_file(path: PathLike) -> Iterator:
    """One .safetensors file opened by the library (tensors are read only when asked for); a file
    it refuses is named with what is wrong (`read_header`'s check), in one line."""
    path = Path(path)
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (listed by the checkpoint)") from None
    except SafetensorError as e:
        read_header(path)  # raises the precise reason when the header shows one
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    with handle as f:
        yield f


def load_file(path: PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of one .safetensors file, copied out of the file."""
    with open_file(path) as f:
        return {name: f.get_tensor(name) for name in sorted(f.keys())}


def save_file(path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write one .safetensors file (tensors in name order), atomically."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _CODES:
            raise CheckpointError(f"tensor '{name}': dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        blobs.append(t)
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to an 8-byte boundary

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in blobs:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    atomic_write(Path(path), write)


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoint directories


def save_checkpoint(path: PathLike, tensors: Mapping[str, torch.Tensor], config: Mapping, shards: int = 1) -> None:
    """Write a Hugging Face checkpoint directory: config.json and the tensors, in one
    model.safetensors or in `shards` files listed by model.safetensors.index.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards <= 1:
        save_file(path / SINGLE_FILE, tensors, metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            part = names[i * per : (i + 1) * per]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(path / file, {n: tensors[n] for n in part}, metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        atomic_write(path / INDEX_FILE, lambda f: f.write(index.encode()))
    text = json.dumps(dict(config), indent=2)
    atomic_write(path / CONFIG_FILE, lambda f: f.write(text.encode()))

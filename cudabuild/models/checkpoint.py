"""Hugging Face checkpoints: config.json plus *.safetensors, one file or shards with an index.

Owns streaming a checkpoint into a model's parameters in place: shard by shard, tensor by tensor,
read through the `safetensors` library (`safe_open`: a memory map, one tensor at a time), so the
weights are never held twice. Also owns a writer of the format (an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}} with an optional `__metadata__`, then
the raw bytes), for tests and benchmarks, and a header check that names what is wrong with a file
the library refuses. Which checkpoint name fills which parameter is the model's business (a
mapping of name -> `Target`); this module knows no model. Must not touch: export, compile, or
anything on the device.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from cudabuild.errors import CudabuildError
from cudabuild.engine.files import atomic_write
from cudabuild.models.safetensors_parts import HeaderError, checked_header, read_raw_header

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


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param[index]`, read transposed (last two dims) if asked.

    The checkpoint tensor must have exactly that view's shape; e.g. Target("moe.w_down", (3,),
    transpose=True) takes a [D, I] tensor into expert 3 of a [E, I, D] parameter.
    """

    param: str
    index: tuple = ()
    transpose: bool = False

    def view(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        t = params[self.param]
        if self.index:
            t = t[self.index]
        return t.transpose(-1, -2) if self.transpose else t


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


def _directory(path: PathLike) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found (expected config.json and *.safetensors)")
    return path


def read_config(path: PathLike) -> dict:
    """The checkpoint's config.json."""
    config = _directory(path) / CONFIG_FILE
    if not config.is_file():
        raise CheckpointError(f"{config}: missing; a Hugging Face checkpoint directory needs its config.json")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from None


def _source(path: Path) -> Path:
    """The file that lists the checkpoint's tensors: the shard index, else the single file."""
    index = path / INDEX_FILE
    if index.is_file():
        return index
    single = path / SINGLE_FILE
    if single.is_file():
        return single
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    what = f"{len(found)} .safetensors files and no {INDEX_FILE}" if found else "no .safetensors file"
    raise CheckpointError(f"{path}: {what}; expected {INDEX_FILE} with shards, or one {SINGLE_FILE}")


def tensor_files(path: PathLike) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> the file that holds it."""
    path = _directory(path)
    source = _source(path)
    if source.name != INDEX_FILE:
        with open_file(source) as f:
            return {name: source for name in f.keys()}
    try:
        weight_map = json.loads(source.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{source}: not a safetensors index (no readable weight_map: {e!r})") from None
    return {name: path / file for name, file in weight_map.items()}


def load_into(
    module: torch.nn.Module,
    path: PathLike,
    targets: Mapping[str, Target],
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Fill `module`'s parameters in place from the checkpoint at `path`.

    `targets` maps every checkpoint name the module needs to where it goes; names for which `skip`
    is true are left unread. Everything is checked before the first byte is copied: a tensor the
    module needs but the checkpoint lacks, or one the checkpoint has but nothing takes, or any
    parameter that no target fills. Shapes are checked tensor by tensor as shards stream in.
    """
    path = _directory(path)
    source = _source(path)
    files = tensor_files(path)
    for name in sorted(files):
        if name not in targets and not skip(name):
            raise CheckpointError(f"unexpected tensor '{name}' in {files[name]}: the model has no such weight")
    missing = [name for name in targets if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor '{missing[0]}'{more} in {source}")

    params = dict(module.named_parameters(remove_duplicate=False))
    for name, target in targets.items():
        if target.param not in params:
            raise CheckpointError(f"tensor '{name}' maps to '{target.param}', which the model does not have")
    filled = {id(params[t.param]) for t in targets.values()}
    for pname, p in params.items():
        if id(p) not in filled:
            raise CheckpointError(f"no tensor of {source} fills the model's parameter '{pname}'")

    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for file in sorted(by_file):
            with open_file(file) as f:
                held = set(f.keys())
                for name in by_file[file]:
                    if name not in held:
                        raise CheckpointError(f"tensor '{name}': {source} lists it in {file}, which does not hold it")
                for name in by_file[file]:
                    dst = targets[name].view(params)
                    shape = list(f.get_slice(name).get_shape())  # from the header: nothing read yet
                    if shape != list(dst.shape):
                        raise CheckpointError(
                            f"tensor '{name}' in {file} has shape {shape}, expected {list(dst.shape)} "
                            f"(for '{targets[name].param}')"
                        )
                    src = f.get_tensor(name)  # one tensor in memory at a time
                    dst.copy_(src)
                    del src


def gather_tensors(module: torch.nn.Module, targets: Mapping[str, Target]) -> dict[str, torch.Tensor]:
    """The inverse of `load_into`: the tensors a checkpoint of `module` holds, by checkpoint name."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {name: target.view(params).detach().contiguous().clone() for name, target in targets.items()}


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

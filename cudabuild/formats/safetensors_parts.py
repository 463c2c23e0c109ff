"""A .safetensors file's header and tensors, read without torch: the header checked, one digest per
tensor as key inputs, and where each tensor's bytes lie.

Owns reading the format's header and the byte ranges it names. Must not touch: torch, a model, a
build's decisions (its callers, cudabuild.pipeline, registry and the quantize stage, say what a
digest keys), or writing the format (cudabuild/formats/safetensors_stream.py).

How a checkpoint shard enters export's key (cudabuild.pipeline): {tensor name: sha256 of its
dtype, shape and bytes}, so a changed shard is explained by the tensors that changed, and a shard
rewritten with the same tensors (a touch, a copy) keys the same. The file is read once, in order,
a chunk at a time; the hash memo (engine.hashing) keeps the result under the file's stat
signature, so a no-op build reads nothing.

`tensor_layouts` is the same without the bytes: each tensor's dtype and shape, from the header
alone (what a stage keyed on the weights' layout, not their values, keys on).

`checked_header` reads only the header and says what is wrong with it (an entry that is not
{dtype, shape, data_offsets}, a dtype the format does not have, offsets that do not span the
shape's bytes, a file too short for them): what a build checks up front, before any stage, for
every file of a checkpoint, without reading tensor data. `header_digest` keys such a check.

Why by hand rather than with the `safetensors` package: the package reads tensors into a framework
(torch, numpy) and does not say where a tensor's bytes lie in the file, which is what hashing them
in one pass and indexing them as spans of the store (`tensor_regions`) need; and this runs in a
build's first second, which imports no torch. The package reads the tensors themselves (ExecuTorch's
loaders, tests). The format: an 8-byte little-endian header length, then a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from cudabuild.engine.hashing import CHUNK, sha256_file

METADATA = "__metadata__"
# Bytes per element of each dtype the format names.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class HeaderError(ValueError):
    """Not a readable safetensors header; the message says why."""


def read_raw_header(path: str | os.PathLike) -> tuple[dict, int, int]:
    """(header entries by name, with __metadata__ if present; the file offset of the first data
    byte; the file's size). Raises HeaderError when the file cannot hold a header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"truncated safetensors file: {size} bytes, no header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise HeaderError(f"truncated safetensors file: header of {n} bytes, file of {size}")
        raw = f.read(n)
    try:
        entries = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"safetensors header is not valid JSON ({e})") from None
    if not isinstance(entries, dict):
        raise HeaderError("safetensors header is not a JSON object")
    return entries, 8 + n, size


def checked_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """({tensor name: {dtype, shape, data_offsets}}, the header's __metadata__) of one file, its
    entries checked against the format and the file's size; HeaderError naming the first entry
    that is wrong. Reads the header only."""
    entries, start, size = read_raw_header(path)
    metadata = entries.pop(METADATA, None) or {}
    end = 0
    for name, e in entries.items():
        if not isinstance(e, dict):
            raise HeaderError(f"tensor '{name}': its header entry is not an object")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise HeaderError(f"tensor '{name}': unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise HeaderError(f"tensor '{name}': shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                or offsets[1] < offsets[0]):
            raise HeaderError(f"tensor '{name}': data_offsets {offsets!r} are not [begin, end]")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * DTYPE_SIZES[dtype]:
            raise HeaderError(f"tensor '{name}': data_offsets span {offsets[1] - offsets[0]} bytes, "
                              f"shape {shape} of {dtype} needs {numel * DTYPE_SIZES[dtype]}")
        end = max(end, offsets[1])
    if start + end > size:
        raise HeaderError(f"truncated safetensors file: the header describes {start + end} bytes, the file has {size}")
    return entries, metadata if isinstance(metadata, dict) else {}


def header_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's header bytes and its size (what checked_header reads), or of its first
    bytes where it has no header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h = hashlib.sha256(f"{size}\n".encode() + head)
        if n <= size - 8:
            h.update(f.read(n))
    return h.hexdigest()


def tensor_regions(path: str | os.PathLike) -> list[tuple[int, int]]:
    """[(offset, length)] of each tensor's bytes in the file (what the store indexes, so that later
    files holding the same bytes are kept as ranges of this one); [] for a file it cannot read."""
    try:
        entries, start, _ = read_raw_header(path)
        return [(start + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0])
                for name, e in entries.items() if name != METADATA]
    except (HeaderError, KeyError, TypeError, IndexError):
        return []


def tensor_layouts(path: str | os.PathLike) -> dict[str, list]:
    """{tensor name: [dtype, shape]} of one .safetensors file, plus the header's __metadata__ when
    it has one: what its tensors are, not what they hold (the header alone is read). A file that
    is not safetensors keys as its whole-file sha256 under "<unreadable>", as in tensor_digests."""
    try:
        entries, _, _ = read_raw_header(path)
        out = {name: [e["dtype"], e["shape"]] for name, e in entries.items() if name != METADATA}
    except (HeaderError, KeyError, TypeError):
        return {"<unreadable>": sha256_file(path)}
    if METADATA in entries:
        out[METADATA] = entries[METADATA]
    return out


def tensor_digests(path: str | os.PathLike) -> dict[str, str]:
    """{tensor name: sha256 of its dtype, shape and bytes} for one .safetensors file, plus the
    header's __metadata__ when it has one. A file that is not safetensors (or is damaged) keys as
    its whole-file sha256 under "<unreadable>", so its stage still reruns when it changes, and
    export then says what is wrong with it."""
    try:
        entries, start, size = read_raw_header(path)
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name, e) for name, e in entries.items() if name != METADATA)
    except (HeaderError, KeyError, TypeError, IndexError):
        return {"<unreadable>": sha256_file(path)}
    out = {}
    if METADATA in entries:
        out[METADATA] = hashlib.sha256(json.dumps(entries[METADATA], sort_keys=True).encode()).hexdigest()
    with open(path, "rb") as f:
        for begin, end, name, entry in spans:
            h = hashlib.sha256(json.dumps([entry.get("dtype"), entry.get("shape")]).encode())
            f.seek(start + begin)
            left = end - begin
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:  # truncated: the digest covers what is there, export reports the rest
                    break
                h.update(chunk)
                left -= len(chunk)
            out[name] = h.hexdigest()
    return out


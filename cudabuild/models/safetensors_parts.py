"""A .safetensors file's tensors as key inputs: one digest per tensor, without torch.

How a checkpoint shard enters export's key (cudabuild.pipeline): {tensor name: sha256 of its
dtype, shape and bytes}, so a changed shard is explained by the tensors that changed, and a shard
rewritten with the same tensors (a touch, a copy) keys the same. The file is read once, in order,
a chunk at a time; the hash memo (engine.hashing) keeps the result under the file's stat
signature, so a no-op build reads nothing.

The header is parsed here rather than by the `safetensors` package: the package reads tensors, but
does not say where a tensor's bytes lie in the file, which is what hashing them in one pass needs.
The format: an 8-byte little-endian header length, then a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

CHUNK = 1 << 20
METADATA = "__metadata__"


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


def tensor_digests(path: str | os.PathLike) -> dict[str, str]:
    """{tensor name: sha256 of its dtype, shape and bytes} for one .safetensors file, plus the
    header's __metadata__ when it has one. A file that is not safetensors (or is damaged) keys as
    its whole-file sha256 under "<unreadable>", so its stage still reruns when it changes, and
    export then says what is wrong with it."""
    try:
        entries, start, size = read_raw_header(path)
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name, e) for name, e in entries.items() if name != METADATA)
    except (HeaderError, KeyError, TypeError, IndexError):
        return {"<unreadable>": _whole_file(path)}
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


def _whole_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()

"""Writing one .safetensors file tensor by tensor, as the tensors are made, never holding them all.

Owns writing the format. Must not touch: what the tensors are (the quantizer hands them over,
cudabuild/models/qwen35_moe_quantize.py), reading (the package; headers: safetensors_parts.py).

The `safetensors` package writes a file from a whole dict of tensors (and its Python `save_file`
copies every tensor into a bytes object first): a 35B model's int4 bundle would sit in host memory
twice. Here the file is written in the order the tensors arrive. The header, which comes first in
the format but is known only at the end, gets a reserved region padded with spaces (the format
allows whitespace after the JSON; its own writer pads to 8 bytes the same way); a header larger
than the reservation moves the data once. Writes happen on a thread of their own, so the producer
(quantizing the next layer on the GPU) is not held up by the disk. The file appears under its
name only once complete (written beside it, then renamed).

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the bytes, contiguous, in offset
order. Reading stays with the `safetensors` package (`safe_open`).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import threading
from pathlib import Path
from typing import Mapping, Optional

import torch

CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
# Room for the header, reserved at the start of the file: 2 KiB a tensor is far more than a
# tensor's entry and its torchao metadata take; `reserve` may say otherwise.
RESERVE_PER_TENSOR = 2048


class SafetensorsStream:
    """`with SafetensorsStream(path, expected_tensors) as out: out.add(tensors); out.metadata.update(...)`."""

    def __init__(self, path: Path | str, expected_tensors: int = 1024, queue_depth: int = 2):
        self.path = Path(path)
        self.reserve = max(4096, expected_tensors * RESERVE_PER_TENSOR)
        self.reserve += -self.reserve % 8
        self.header: dict = {}
        self.metadata: dict[str, str] = {}
        self.offset = 0
        self._partial = self.path.with_name(f".{self.path.name}.partial")
        self._file = open(self._partial, "wb")
        self._file.write(b"\0" * (8 + self.reserve))
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._error: Optional[BaseException] = None
        self._writer = threading.Thread(target=self._write_loop, name="safetensors-writer", daemon=True)
        self._writer.start()

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Append tensors (moved to the CPU here, written in the given order on the writer thread)."""
        batch = []
        for name, tensor in tensors.items():
            if name in self.header or name == "__metadata__":
                raise ValueError(f"tensor '{name}' is written twice")
            t = tensor.detach().to("cpu").contiguous()
            if t.dtype not in CODES:
                raise ValueError(f"tensor '{name}': dtype {t.dtype} has no safetensors code")
            nbytes = t.numel() * t.element_size()
            self.header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                                 "data_offsets": [self.offset, self.offset + nbytes]}
            self.offset += nbytes
            batch.append(t)
        self._raise_if_failed()
        self._queue.put(batch)

    def _write_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                if self._error is None:
                    for t in batch:
                        if t.numel():
                            self._file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            except BaseException as e:  # reported to the producer at its next add, or at close
                self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> Path:
        """Finish the file: the header into its reserved room (or the data moved to make room), renamed into place."""
        self._queue.put(None)
        self._writer.join()
        self._raise_if_failed()
        entries = dict(self.header)
        if self.metadata:
            entries["__metadata__"] = {str(k): str(v) for k, v in self.metadata.items()}
        raw = json.dumps(entries, separators=(",", ":")).encode()
        if len(raw) > self.reserve:
            self._file.close()
            self._move_data(len(raw) + (-len(raw) % 8))
            self._file = open(self._partial, "r+b")
        raw += b" " * (self.reserve - len(raw))
        self._file.seek(0)
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)
        return self.path

    def _move_data(self, room: int) -> None:
        """A header that outgrew its room: copy the data after a larger one (rare: a bad estimate)."""
        bigger = self._partial.with_name(self._partial.name + ".grown")
        with open(self._partial, "rb") as src, open(bigger, "wb") as dst:
            dst.write(b"\0" * (8 + room))
            src.seek(8 + self.reserve)
            shutil.copyfileobj(src, dst, 1 << 24)
        os.replace(bigger, self._partial)
        self.reserve = room

    def abort(self) -> None:
        self._queue.put(None)
        self._writer.join()
        self._file.close()
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

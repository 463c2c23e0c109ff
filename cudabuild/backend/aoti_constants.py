"""The constants table of a compiled AOTInductor .so, and its weights blob checked against a program.

torch's runner loads a weights blob by reading the whole file and copying every constant out of
it: for a moment the process holds the weights twice, which for a real checkpoint is more memory
than the machine has. On the CPU, verify instead hands the runner the program's own weights, mapped
from the store, as user-managed constants (no copy), after checking here that the blob holds
exactly those bytes where the .so will look for them. So what runs is still what the blob would
load, and nothing is held twice.

The table comes from the .so's own C API (AOTInductorModelContainerGetConstant*: name, original
FQN, byte size, whether inductor folded it), in index order, which is the blob's order. The blob
is the unfolded constants back to back, each starting at a multiple of 64 bytes on the CPU
(torch/_inductor/codecache.py writes it so; on CUDA they are packed). Any disagreement (a total
that is not the blob's size, a constant without a program tensor) makes `check_blob` say so, and
verify then loads the blob the ordinary way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

CPU_ALIGNMENT = 64
_CHUNK = 1 << 24


@dataclass(frozen=True)
class Constant:
    name: str
    fqn: str
    nbytes: int
    folded: bool


def constants_table(so_path: str) -> list[Constant]:
    """The .so's constants in index order (libtorch must already be loaded RTLD_GLOBAL)."""
    lib = ctypes.CDLL(so_path)
    handle = ctypes.c_void_p()
    _check(lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(handle), ctypes.c_size_t(1), b"cpu", None),
           "create a container")
    try:
        count = ctypes.c_size_t()
        _check(lib.AOTInductorModelContainerGetNumConstants(handle, ctypes.byref(count)), "count its constants")
        table = []
        for i in range(count.value):
            name, fqn = ctypes.c_char_p(), ctypes.c_char_p()
            size, folded = ctypes.c_size_t(), ctypes.c_bool()
            index = ctypes.c_size_t(i)
            _check(lib.AOTInductorModelContainerGetConstantName(handle, index, ctypes.byref(name)), "name a constant")
            _check(lib.AOTInductorModelContainerGetConstantOriginalFQN(handle, index, ctypes.byref(fqn)), "read a constant's FQN")
            _check(lib.AOTInductorModelContainerGetConstantDataSize(handle, index, ctypes.byref(size)), "size a constant")
            _check(lib.AOTInductorModelContainerGetConstantFromFolded(handle, index, ctypes.byref(folded)), "read a constant's origin")
            table.append(Constant(name.value.decode(), (fqn.value or b"").decode(), size.value, folded.value))
        return table
    finally:
        lib.AOTInductorModelContainerDelete(handle)


def _check(status: int, doing: str) -> None:
    if status != 0:
        raise RuntimeError(f"the compiled .so failed to {doing} (AOTI status {status})")


def check_blob(blob: Path, table: list[Constant], tensors: Mapping[str, object], mapped=None) -> Optional[str]:
    """None when the CPU weights blob holds, at the .so's offsets, exactly the bytes of the program
    tensors the table names (by FQN); else what disagrees, in words. Streams the blob, so memory
    holds one chunk of it at a time beside the tensors; the pages of the tensors' own chunks are
    dropped once compared where `mapped` (mapped_weights.Mapped) says they are mapped weights."""
    offset, spans = 0, []
    for c in table:
        if c.folded:
            continue
        tensor = tensors.get(c.fqn)
        if tensor is None:
            return f"constant {c.name} has no tensor in the program (FQN {c.fqn!r})"
        storage = tensor.untyped_storage()
        if storage.nbytes() != c.nbytes:
            return f"constant {c.name} is {c.nbytes} bytes in the .so, {storage.nbytes()} in the program"
        spans.append((offset, c, storage))
        offset += -(-c.nbytes // CPU_ALIGNMENT) * CPU_ALIGNMENT
    size = blob.stat().st_size
    if size != offset:
        return f"the weights blob is {size} bytes; the .so's constants take {offset}"
    with open(blob, "rb") as f:
        for start, c, storage in spans:
            f.seek(start)
            done = 0
            while done < c.nbytes:
                n = min(_CHUNK, c.nbytes - done)
                got = f.read(n)
                want = ctypes.string_at(storage.data_ptr() + done, n)
                if got != want:
                    return f"the weights blob's bytes for {c.fqn} differ from the program's"
                if mapped is not None:
                    mapped.drop(storage.data_ptr() + done, n)
                done += n
    return None

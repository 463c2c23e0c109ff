"""The constants table of a compiled AOTInductor .so, and its weights blob: read, checked, written.

The weights blob AOTInductor writes beside a .so (`package_constants_on_disk_format=binary_blob`)
is the .so's unfolded constants back to back, in the order of the graph's constants (the .so's
index order), each its tensor's whole storage from the storage's start (the .so adds the tensor's
storage offset itself), each starting at a multiple of 64 bytes with zeros between, unless every
constant is on the GPU, where they are packed (torch/_inductor/codecache.py, AotCodeCompiler.compile).
So a blob is a function of the table (names, FQNs, sizes, order, layout) and the tensors' bytes:

- `captured_table()` records the table inductor compiles (`table_of_graph`), with each constant's
  program FQN, dtype, shape, strides and storage offset, as JSON (a compile's `constants.json`),
  and each constant's original value (what the blob holds) beside it; with `keep_out`, inductor's
  serializer is handed none of those values, so AOTInductor's own blob is never built;
- `source_problem(table, sources, tensors)` says where the blob those values make is not exactly
  the table applied to a program's tensors (None: byte for byte, padding included), a value that
  is the program's own tensor by identity, any other by its bytes: the compile stage asks it,
  which is what makes a table *rewritable*; `blob_problem(blob, table, tensors)` asks the same of
  a blob file (the blob stage's own compile, which keeps AOTInductor's blob);
- `write_blob(path, table, tensors)` writes the blob the build keeps (cudabuild.backend.stages.blob),
  hashing it as it goes and leaving holes where the store holds a constant's bytes already, and
  `fit_problem` says first why a table cannot take the tensors;
- `constants_table(so)` reads the table from the .so itself (its C API), which the blob stage
  compares with the JSON it was handed (`so_table_problem`).

Verify uses the same reading: torch's runner loads a weights blob by reading the whole file and
copying every constant out of it, for a moment holding the weights twice, which for a real
checkpoint is more memory than the machine has. On the CPU, verify instead hands the runner the
program's own weights, mapped from the store, as user-managed constants (no copy), after checking
here (`check_blob`) that the blob holds exactly those bytes where the .so will look for them.

The table comes from the .so's own C API (AOTInductorModelContainerGetConstant*: name, original
FQN, byte size, whether inductor folded it), in index order, which is the blob's order.
Nothing here imports torch at module level; the functions that read tensors get them handed in.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from cudabuild.engine import spans

CPU_ALIGNMENT = 64  # torch._inductor.utils.ALIGN_BYTES: where each constant starts in a CPU blob
_CHUNK = 1 << 24
TABLE_VERSION = 1


@dataclass(frozen=True)
class Constant:
    name: str
    fqn: str
    nbytes: int
    folded: bool


def promote_libtorch(device: str) -> None:
    """Make libtorch's symbols global: a .so built without libtorch (link_libtorch=False) resolves
    its `aoti_torch_*` symbols only so, and torch loads libtorch RTLD_LOCAL."""
    import os

    import torch

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = ["libtorch_cpu.so"] + (["libtorch_cuda.so"] if device == "cuda" else [])
    for name in names:
        ctypes.CDLL(os.path.join(lib_dir, name), mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)


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


# -- the table a compile produces, and the blob for other weights ----------------------------------


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def table_of_graph(graph, sources: Optional[dict] = None) -> dict:
    """What decides the weights blob of the .so inductor is about to write for `graph` (a
    GraphLowering): its unfolded constants in order, each by name, program FQN, byte size (its
    whole storage), offset in the blob, dtype, shape, strides, storage offset and device; the
    layout (64-byte aligned, or packed when every constant is on the GPU) and the total size."""
    flat = getattr(graph, "dynamo_flat_name_to_original_fqn", {}) or {}
    names = [n for n in graph.constants if n not in graph.folded_constants]
    values = {n: graph.get_original_value_of_constant(n) for n in names}
    if sources is not None:
        sources.update(values)
    all_gpu = all(values[n].is_cuda for n in names)
    alignment = 1 if all_gpu else CPU_ALIGNMENT
    rows, offset, unsupported = [], 0, []
    for name in names:
        t = values[name]
        if getattr(t, "is_mkldnn", False):
            unsupported.append(f"constant {name} is an mkldnn tensor")
            nbytes = 0
        else:
            nbytes = t.untyped_storage().nbytes() if t.numel() else 0
        rows.append({"name": name, "fqn": flat.get(name) or graph.allocated_constant_name.get(name, name),
                     "offset": offset, "nbytes": nbytes, "dtype": str(t.dtype).removeprefix("torch."),
                     "shape": list(t.shape), "stride": list(t.stride()), "storage_offset": int(t.storage_offset()),
                     "device": t.device.type})
        offset += nbytes if all_gpu else _aligned(nbytes, alignment)
    return {"version": TABLE_VERSION, "alignment": alignment, "size": offset, "constants": rows,
            "folded": sorted(graph.folded_constants), "unsupported": unsupported}


class CapturedTable(dict):
    """The table of the .so AOTInductor compiled (`table_of_graph`, as JSON data), and beside it,
    not in the data, `sources`: each constant's original value by name, what its weights blob holds."""

    sources: dict


@contextlib.contextmanager
def captured_table(keep_out: bool = False) -> Iterator[CapturedTable]:
    """Within the block, the table of the (last) .so AOTInductor compiles is put in the dict
    yielded (`table_of_graph`), taken as its compiler starts writing the .so and its blob, with
    each constant's original value in its `sources`.

    With `keep_out`, inductor's serializer is handed no constant's values: it writes an empty
    weights blob, the .so records the table's blob size as its own, and the source of every byte
    the blob would have held is in `sources` for `source_problem`. Why: AOTInductor builds that
    blob in memory from the program's weights before writing it whole (torch 2.11 joins one bytes
    object per constant, so for a moment it holds them twice): at 40 layers of a 35B MoE, 20 GB a
    method, and the compiles' resident sets reached 76 GiB (H100, 2026-12-06). The blob stage
    writes the one the build keeps, by the table (write_blob), so the compile's own would only
    prove that table, which its sources prove as well. The .so's own wrapper code (shapes, strides,
    sizes, devices of its constants) is written before the serializer runs, from the real values,
    and is the same either way."""
    from torch._inductor import codecache

    found = CapturedTable()
    found.sources = {}
    original = codecache.AotCodeCompiler.__dict__["compile"]

    def compile(cls, graph, *args, **kwargs):
        found.clear()
        found.sources = {}
        try:
            found.update(table_of_graph(graph, found.sources))
        except Exception as e:  # another inductor: no table, so no other weights for this .so
            found["error"] = f"inductor's constants could not be read ({type(e).__name__}: {e})"
        if not keep_out or "error" in found:
            return original.__func__(cls, graph, *args, **kwargs)
        with _serializer_handed_no_values(graph, codecache, found["size"]):
            return original.__func__(cls, graph, *args, **kwargs)

    codecache.AotCodeCompiler.compile = classmethod(compile)
    try:
        yield found
    finally:
        codecache.AotCodeCompiler.compile = original


@contextlib.contextmanager
def _serializer_handed_no_values(graph, codecache, size: int) -> Iterator[None]:
    """Within the block, `graph` answers for each constant's original value with an empty tensor of
    its device and dtype (so the serializer's layout choice, all on the GPU or not, is unchanged
    and it copies nothing), the size AOTInductor records in the .so for an external weights blob,
    `struct.pack("q", <the blob's length>)` in codecache, is `size`, the table's, and the empty
    blob is written nowhere. All for this compile only: an instance attribute of `graph`, and
    codecache's module globals `struct` and `open` (what its compiler calls) in place of the
    module and the builtin."""
    import struct

    import torch

    def valueless(name):
        t = original_value(name)
        return torch.empty(0, dtype=t.dtype, device=t.device)

    import builtins

    def opener(file, mode="r", *args, **kwargs):
        if "w" in mode and str(file).endswith("_weights.blob"):
            return open(os.devnull, mode, *args, **kwargs)  # the empty blob: nothing to keep
        return builtins.open(file, mode, *args, **kwargs)

    original_value = graph.get_original_value_of_constant
    graph.get_original_value_of_constant = valueless
    saved = {name: codecache.__dict__.get(name) for name in ("struct", "open")}
    codecache.struct = _BlobSize(size)
    codecache.open = opener
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                codecache.__dict__.pop(name, None)
            else:
                setattr(codecache, name, value)
        del graph.get_original_value_of_constant


class _BlobSize:
    """`struct`, except that packing the empty blob's length as "q" gives the table's size."""

    def __init__(self, size: int):
        self.size = size

    def pack(self, fmt, *values):
        import struct

        if fmt == "q" and values == (0,):
            return struct.pack("q", self.size)
        return struct.pack(fmt, *values)

    def __getattr__(self, name):
        import struct

        return getattr(struct, name)


def source_problem(table: dict, sources: Mapping[str, object], tensors: Mapping[str, object]) -> Optional[str]:
    """None when the weights blob AOTInductor would have written for `table` (each constant's
    `sources` value's storage at its offset, zeros between: captured_table) is, byte for byte, what
    write_blob writes for the program's `tensors` under it, and every program tensor whose values
    the code digest leaves out is a constant of it; else the first difference, in words.

    A source that is the program's tensor itself (the same storage, offset, dtype and strides: a
    weight the compile kept on the host, or a CPU program's mapped weight) holds its bytes by
    identity; any other (a device copy, a CPU clone of a mutated buffer, a freed KV cache's zeros)
    is compared a chunk at a time (read from the device where it lives there)."""
    problem = table_problem(table) or fit_problem(table, tensors) or unread_problem(table, tensors)
    if problem:
        return problem
    for row in table["constants"]:
        source, t = sources.get(row["name"]), tensors[row["fqn"]]
        if source is None:
            return f"inductor named no value for constant {row['name']} ({row['fqn']})"
        if _same_storage(source, t):
            continue
        storage = source.untyped_storage()
        if storage.nbytes() != row["nbytes"]:
            return f"constant {row['name']} holds {storage.nbytes()} bytes for {row['fqn']}, its table {row['nbytes']}"
        for done in range(0, row["nbytes"], _CHUNK):
            n = min(_CHUNK, row["nbytes"] - done)
            if _source_bytes(storage, done, n) != _storage_bytes(t, done, n):
                return f"the weights blob's bytes for {row['fqn']} differ from the program's"
    return None


def _same_storage(a, b) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return (a.device == b.device and sa.data_ptr() == sb.data_ptr() and sa.nbytes() == sb.nbytes()
            and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype and a.stride() == b.stride())


def _source_bytes(storage, start: int, n: int) -> bytes:
    if storage.device.type == "cpu":
        return ctypes.string_at(storage.data_ptr() + start, n)
    import torch

    piece = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (n,), (1,))
    return piece.cpu().numpy().tobytes()


def table_problem(table) -> Optional[str]:
    """Why `table` (a compile's constants.json, parsed) is not a table this module wrote, in
    words; None when it is well formed and its offsets follow its layout."""
    if isinstance(table, dict) and table.get("error"):
        return table["error"]
    if not isinstance(table, dict) or table.get("version") != TABLE_VERSION:
        return f"its constant table is not of version {TABLE_VERSION}"
    rows, alignment = table.get("constants"), table.get("alignment")
    if not isinstance(rows, list) or alignment not in (1, CPU_ALIGNMENT) or not isinstance(table.get("size"), int):
        return "its constant table is malformed"
    offset = 0
    for row in rows:
        fields = ("name", "fqn", "offset", "nbytes", "dtype", "shape", "stride", "storage_offset")
        if not isinstance(row, dict) or any(f not in row for f in fields):
            return "its constant table has a malformed row"
        if row["offset"] != offset or not isinstance(row["nbytes"], int) or row["nbytes"] < 0:
            return f"its constant table places {row['name']} at {row['offset']}, not {offset}"
        offset += row["nbytes"] if alignment == 1 else _aligned(row["nbytes"], alignment)
    if offset != table["size"]:
        return f"its constant table adds up to {offset} bytes, not the {table['size']} it states"
    if table.get("folded"):
        return f"the .so folds constants ({', '.join(table['folded'][:3])}): their values are computed from the weights at compile time"
    if table.get("unsupported"):
        return table["unsupported"][0]
    return None


def fit_problem(table: dict, tensors: Mapping[str, object]) -> Optional[str]:
    """Why the program `tensors` (by FQN) cannot fill `table`'s constants, in words: a constant
    with no tensor of its FQN, or one of another dtype, shape, strides, storage offset or size."""
    for row in table["constants"]:
        t = tensors.get(row["fqn"])
        if t is None:
            return f"constant {row['name']} has no tensor {row['fqn']!r} in the program"
        nbytes = t.untyped_storage().nbytes() if t.numel() else 0
        have = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride()),
                "storage_offset": int(t.storage_offset()), "nbytes": nbytes}
        for field, value in have.items():
            if row[field] != value:
                return f"constant {row['fqn']} has {field} {value} in the program, {row[field]} in the .so"
    return None


def _storage_bytes(t, start: int, n: int) -> bytes:
    """Bytes [start, start + n) of a CPU tensor's whole storage (the program's tensors, mapped)."""
    storage = t.untyped_storage()
    if storage.device.type != "cpu":
        raise ValueError(f"a weights blob is written from CPU tensors, not {storage.device.type} ones")
    return ctypes.string_at(storage.data_ptr() + start, n)


def write_blob(path: Path, table: dict, tensors: Mapping[str, object],
               stored: Optional[Callable[[str, int], bool]] = None) -> tuple[str, list[tuple[int, int, str]]]:
    """The weights blob for `tensors` (by FQN) under `table` (check `fit_problem` first): each
    constant's storage at its offset, zeros between, one chunk in memory at a time. Returns its
    sha256 and each constant's (offset, length, sha256 of its bytes): the file is hashed as it
    is written, never read back.

    With `stored(sha, length)` (StageContext.holds: the store has these bytes already), a constant
    it says yes to is left out as a hole, so the file takes on the disk only what the store does
    not hold yet; the store then keeps it as ranges of the blobs that do (ObjectStore.put_file with
    digested regions). A constant's bytes are read twice then: once to hash them, once (only when
    not stored) to write them."""
    from concurrent.futures import ThreadPoolExecutor

    whole, regions, at = hashlib.sha256(), [], 0
    # The two digests of each chunk side by side: hashlib lets go of the GIL for big updates, and
    # at 40 layers of a 35B MoE each is 20 GB a method.
    with open(path, "wb") as f, ThreadPoolExecutor(1) as beside:
        for row in table["constants"]:
            whole.update(bytes(row["offset"] - at))
            t, nbytes = tensors[row["fqn"]], row["nbytes"]
            region = spans.RegionHasher()
            for done in range(0, nbytes, _CHUNK):
                chunk = _storage_bytes(t, done, min(_CHUNK, nbytes - done))
                hashed = beside.submit(region.update, chunk)
                whole.update(chunk)
                hashed.result()
            sha = region.digest()
            regions.append((row["offset"], nbytes, sha))
            at = row["offset"] + nbytes
            if nbytes and (sha == spans.ZEROS or (stored is not None and stored(sha, nbytes))):
                continue  # a hole: zeros, or bytes the store holds
            f.seek(row["offset"])
            for done in range(0, nbytes, _CHUNK):
                f.write(_storage_bytes(t, done, min(_CHUNK, nbytes - done)))
        whole.update(bytes(table["size"] - at))
        f.truncate(table["size"])
    return whole.hexdigest(), regions


def table_regions(table: Optional[dict]) -> list[tuple[int, int]]:
    """[(offset, length)] of each constant's bytes in a weights blob laid out by `table`: where the
    store may find them in the files the weights came from (cudabuild.engine.spans)."""
    rows = (table or {}).get("constants") or []
    return [(row["offset"], row["nbytes"]) for row in rows if isinstance(row, dict) and row.get("nbytes")]


def unread_problem(table: dict, tensors: Mapping[str, object]) -> Optional[str]:
    """Why the .so may hold a weight's values in its code: a program tensor of more than one element
    (whose values the code digest leaves out) that is no constant of the .so. Inductor inlines small
    1-D constants (the compile turns that off where this torch has the switch) and could consume
    others at compile time; either way new values of it would not reach the code, so the table must
    not be given other weights."""
    in_table = {row["fqn"] for row in table["constants"]}
    for fqn, t in sorted(tensors.items()):
        if fqn not in in_table and getattr(t, "numel", lambda: 0)() > 1:
            return f"the program's tensor {fqn} is no constant of the .so: its values may be in the code"
    return None


def blob_problem(blob, table: dict, tensors: Mapping[str, object]) -> Optional[str]:
    """None when `blob` (a file, or a buffer) is, byte for byte, what
    write_blob writes for `tensors` under `table` (padding included), and every program tensor
    whose values the code digest leaves out is a constant of it; else the first difference, in words."""
    problem = table_problem(table) or fit_problem(table, tensors) or unread_problem(table, tensors)
    if problem:
        return problem
    size = len(memoryview(blob)) if not isinstance(blob, (str, Path)) else Path(blob).stat().st_size
    if size != table["size"]:
        return f"the weights blob is {size} bytes; the constant table says {table['size']}"
    with (open(blob, "rb") if isinstance(blob, (str, Path)) else io.BufferedReader(_BufferView(blob))) as f:
        at = 0
        for row in table["constants"]:
            gap = f.read(row["offset"] - at)
            if gap.strip(b"\0"):
                return f"the weights blob holds other bytes than zeros before {row['fqn']}"
            done = 0
            while done < row["nbytes"]:
                n = min(_CHUNK, row["nbytes"] - done)
                if f.read(n) != _storage_bytes(tensors[row["fqn"]], done, n):
                    return f"the weights blob's bytes for {row['fqn']} differ from the program's"
                done += n
            at = row["offset"] + row["nbytes"]
        if f.read().strip(b"\0"):
            return "the weights blob holds other bytes than zeros after its last constant"
    return None


class _BufferView(io.RawIOBase):
    """A buffer read as a file, without a copy of it (io.BytesIO would copy gigabytes)."""

    def __init__(self, data):
        super().__init__()
        self.view, self.at = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), len(self.view) - self.at)
        buffer[:n] = self.view[self.at:self.at + n]
        self.at += n
        return n


def so_table_problem(table: dict, so_table: list[Constant]) -> Optional[str]:
    """Why the .so's own constants (constants_table) are not `table`'s, in words, or None. The .so
    states a CPU constant's size rounded up to the alignment."""
    ours = [(r["name"], r["fqn"], r["nbytes"] if table["alignment"] == 1 else _aligned(r["nbytes"], table["alignment"]))
            for r in table["constants"]]
    theirs = [(c.name, c.fqn, c.nbytes) for c in so_table if not c.folded]
    if len(ours) != len(theirs):
        return f"the .so has {len(theirs)} constants, its constant table {len(ours)}"
    for (name, fqn, nbytes), (so_name, so_fqn, so_nbytes) in zip(ours, theirs):
        if (name, fqn, nbytes) != (so_name, so_fqn, so_nbytes):
            return f"the .so's constant {so_name} ({so_fqn}, {so_nbytes} bytes) is {name} ({fqn}, {nbytes} bytes) in its constant table"
    return None


def read_table(data: bytes) -> dict | str:
    """A constants.json's table, or why it cannot be read, in words."""
    try:
        table = json.loads(data)
    except ValueError as e:
        return f"its constant table is not JSON ({e})"
    return table_problem(table) or table

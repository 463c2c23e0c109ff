"""Blobs kept as ranges of other blobs: one copy of a tensor's bytes across the files that hold it.

A big model's weights pass through several files that each hold all of them: the quantized
bundle, the exported program's weight files, AOTInductor's weights blob, the .ptd. Stored as blobs
of their own, a 35B-A3B build at 8 layers held 6-7 copies (issue 45). Here a file whose big
regions are bytes the store holds already is stored as *spans*: a manifest {size, parts} whose
parts are ranges of other, plain blobs, runs of zeros, or a few literal bytes (the glue: headers,
alignment). The bytes are found by content, through an index the store keeps: when a file is
stored plainly, the regions its producer declares (a tensor's data in a safetensors file or a
torch.save archive, a constant in AOTInductor's blob) are entered as raw sha256 -> (blob, offset,
length); a whole blob is found by its own sha256. A later file whose declared regions are all
found, and whose glue is small, becomes a manifest of a few hundred bytes a tensor.

Reading: `SpanReader` gives a manifest's bytes as a file, streamed (restoring into build/,
uploading to a shared tier, hashing) or read at random (a torch.save archive's members); a reader that must map a path gets the bytes materialized once beside the store
(ObjectStore.verified_path), a file gc may delete at any time. Every read is checked against the
blob's sha256, as a plain blob's is, so a range whose source changed or went missing is never
served: the blob reads as missing and its producer runs again.

Owns the manifest format, finding regions and planning a manifest, and its one reader. Must not
touch diskcache (cudabuild.engine.object_store holds the entries) or anything above the engine.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import io
import os
from typing import Callable, Iterable, Optional, Sequence

from cudabuild.engine.hashing import CHUNK
from cudabuild.errors import CudabuildError

# A region smaller than this is glue, copied into the manifest rather than looked up
# ($CUDABUILD_SPANS_MIN_REGION, bytes: the tests lower it to see spans in a small model's build).
# A bad value is the default here: read at import, it cannot stop with a traceback, and the
# check before anything runs (cudabuild.environment) says what is wrong with it.
_GIVEN = os.environ.get("CUDABUILD_SPANS_MIN_REGION", "").strip()
MIN_REGION = int(_GIVEN) if _GIVEN.isdigit() else 64 << 10
# A manifest holding more literal bytes than this moves them into a blob of glue of their own (spilled).
MAX_LITERAL = 1 << 20
# Nor is one of more than this share of the file's size (a small model's files: mostly glue).
MAX_MANIFEST_SHARE = 1 / 8

Part = list  # ["blob", sha, offset, length] | ["zeros", length] | ["bytes", base64]
# raw sha256 -> (blob sha, offset, length) of a plain blob holding those bytes, or a manifest's parts
Locate = Callable[[str, int], Optional[Sequence[Part]]]


def part_length(part: Part) -> int:
    kind = part[0]
    if kind == "blob":
        return part[3]
    if kind == "zeros":
        return part[1]
    return len(base64.b64decode(part[1]))


def referenced(manifest: dict) -> set[str]:
    """The plain blobs a manifest reads from."""
    return {part[1] for part in manifest["parts"] if part[0] == "blob"}


ZEROS = "zeros"  # the digest region_digests gives a region of zeros only (a buffer at its initial value)


def region_digests(path, regions: Iterable[tuple[int, int]]) -> list[tuple[int, int, str]]:
    """[(offset, length, sha256 of those bytes, or ZEROS for zeros only)] of a file's regions, in
    offset order, overlapping ones and those past the file's end left out."""
    out, end_of_last, zeros = [], 0, bytes(CHUNK)
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        for offset, length in sorted(set(regions)):
            if length <= 0 or offset < end_of_last or offset + length > size:
                continue
            f.seek(offset)
            h, left, all_zero = hashlib.sha256(), length, True
            while left:
                chunk = f.read(min(CHUNK, left))
                h.update(chunk)
                all_zero = all_zero and chunk == zeros[:len(chunk)]
                left -= len(chunk)
            out.append((offset, length, ZEROS if all_zero else h.hexdigest()))
            end_of_last = offset + length
    return out


def digested_regions(path, regions: Iterable[tuple]) -> list[tuple[int, int, str]]:
    """region_digests of `regions`, where a region its producer hashed already comes as
    (offset, length, sha256 or ZEROS) and is taken as it is, not read (it may be a hole: see
    ObjectStore.put_file); in offset order, overlapping ones and those past the file's end left out."""
    regions = list(regions)
    given = {(r[0], r[1]): r[2] for r in regions if len(r) == 3}
    read = region_digests(path, [(r[0], r[1]) for r in regions if len(r) == 2]) if len(given) < len(regions) else []
    found = {(offset, length): sha for offset, length, sha in read}
    found.update(given)
    size = os.path.getsize(path)
    out, end_of_last = [], 0
    for (offset, length), sha in sorted(found.items()):
        if length <= 0 or offset < end_of_last or offset + length > size:
            continue
        out.append((offset, length, sha))
        end_of_last = offset + length
    return out


class SparseNotKept(CudabuildError):
    """A file its producer wrote with holes where the store held its bytes, which cannot be kept
    as spans after all (a blob it would read from went in the meantime): storing it plainly would
    store the holes."""


def has_holes(path) -> bool:
    """Whether the file has holes (its producer left bytes out), where the filesystem can say."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            return size > 0 and os.lseek(f.fileno(), 0, os.SEEK_HOLE) < size
        except (AttributeError, OSError):
            return False


def is_written(f, offset: int, length: int) -> bool:
    """Whether bytes [offset, offset + length) of the open file `f` are all data, no hole among
    them (where the filesystem cannot say: True)."""
    try:
        return (os.lseek(f.fileno(), offset, os.SEEK_DATA) == offset
                and os.lseek(f.fileno(), offset, os.SEEK_HOLE) >= offset + length)
    except (AttributeError, OSError):  # ENXIO: only a hole from offset to the end
        return not hasattr(os, "SEEK_DATA")


class RegionHasher:
    """The sha256 of a region's bytes as they are produced, chunk by chunk, and whether they are
    all zeros (ZEROS): what a producer hands put_file as a digested region."""

    def __init__(self):
        self._h, self._zero = hashlib.sha256(), True

    def update(self, chunk) -> None:
        self._h.update(chunk)
        if self._zero:  # a zeros buffer is cheap to make; once a byte is not zero, never asked again
            self._zero = chunk == bytes(len(chunk))

    def digest(self) -> str:
        return ZEROS if self._zero else self._h.hexdigest()


def plan(path, size: int, regions: list[tuple[int, int, str]], locate: Locate) -> Optional[list[Part]]:
    """The manifest's parts for a file of `size` bytes whose `regions` (region_digests) the store
    may hold already, or None when it should be stored plainly: a region of MIN_REGION or more
    that `locate` does not find, or no region found at all. Its glue is literal bytes, however
    much (see `literal_bytes` and `spilled`)."""
    parts: list[Part] = []
    literal = found = 0
    at = 0
    with open(path, "rb") as f:

        def glue(start: int, end: int) -> bool:
            nonlocal literal
            f.seek(start)
            data = f.read(end - start)
            if not data.strip(b"\0"):
                parts.append(["zeros", len(data)])
                return True
            literal += len(data)
            parts.append(["bytes", base64.b64encode(data).decode()])
            return True  # much glue is spilled into a blob of its own (spilled), or stored plainly

        for offset, length, sha in regions:
            if offset > at and not glue(at, offset):
                return None
            if sha == ZEROS:  # a buffer still at its initial zeros (a KV cache)
                parts.append(["zeros", length])
                at = offset + length
                continue
            where = locate(sha, length) if length >= MIN_REGION else None
            if where is None:
                if length >= MIN_REGION:
                    return None
                if not glue(offset, offset + length):
                    return None
            else:
                parts.extend(where)
                found += length
            at = offset + length
        if size > at and not glue(at, size):
            return None
    return _merged(parts) if found else None


def literal_bytes(parts: Sequence[Part]) -> int:
    return sum(part_length(p) for p in parts if p[0] == "bytes")


def spilled(parts: Sequence[Part], put_glue: Callable[[bytes], str]) -> list[Part]:
    """`parts` with their literal bytes moved into one blob of glue (`put_glue(data) -> sha`), each
    a range of it: a weights blob of thousands of small constants (norms, biases, a few KB each;
    megabytes at 40 layers) keeps a small manifest and its glue once."""
    glue, out = bytearray(), []
    for part in parts:
        if part[0] == "bytes":
            data = base64.b64decode(part[1])
            out.append(["glue", len(glue), len(data)])
            glue += data
        else:
            out.append(list(part))
    sha = put_glue(bytes(glue))
    return _merged([["blob", sha, p[1], p[2]] if p[0] == "glue" else p for p in out])


def _merged(parts: list[Part]) -> list[Part]:
    """Adjacent ranges of one blob, and adjacent runs of zeros, as one part each."""
    out: list[Part] = []
    for part in parts:
        last = out[-1] if out else None
        if last and last[0] == part[0] == "blob" and last[1] == part[1] and last[2] + last[3] == part[2]:
            out[-1] = ["blob", last[1], last[2], last[3] + part[3]]
        elif last and last[0] == part[0] == "zeros":
            out[-1] = ["zeros", last[1] + part[1]]
        else:
            out.append(list(part))
    return out


def shifted(parts: Sequence[Part], start: int, length: int) -> list[Part]:
    """The parts covering bytes [start, start + length) of the manifest `parts` describe."""
    out, at, end = [], 0, start + length
    for part in parts:
        n = part_length(part)
        lo, hi = max(start, at), min(end, at + n)
        if lo < hi:
            if part[0] == "blob":
                out.append(["blob", part[1], part[2] + lo - at, hi - lo])
            elif part[0] == "zeros":
                out.append(["zeros", hi - lo])
            else:
                data = base64.b64decode(part[1])[lo - at:hi - at]
                out.append(["bytes", base64.b64encode(data).decode()])
        at += n
        if at >= end:
            break
    return out


class SpanReader(io.RawIOBase):
    """A manifest's bytes as a file: streamed in order (restoring into build/, uploading to a shared
    tier, hashing), or read at random (zipfile finding a torch.save archive's members without the
    archive written out whole: cudabuild.backend.programs). `open_blob(sha)` opens a plain blob's
    file for reading; each is opened once, when a part first reads from it."""

    def __init__(self, manifest: dict, open_blob: Callable[[str], "io.BufferedReader"]):
        super().__init__()
        self.manifest, self._open_blob = manifest, open_blob
        # Each part as (kind, source, start, length): a blob's sha256 and the offset of the range in
        # it, a literal's decoded bytes, or zeros; `starts` holds where each begins in the manifest's bytes.
        self.parts: list[tuple] = []
        self.starts: list[int] = []
        at = 0
        for part in manifest["parts"]:
            if part[0] == "blob":
                entry = ("blob", part[1], part[2], part[3])
            elif part[0] == "zeros":
                entry = ("zeros", None, 0, part[1])
            else:
                data = base64.b64decode(part[1])
                entry = ("bytes", data, 0, len(data))
            self.parts.append(entry)
            self.starts.append(at)
            at += entry[3]
        self.size, self.position = at, 0
        self._files: dict[str, io.BufferedReader] = {}
        self._file_at: dict[str, int] = {}  # where each open file was left: read on without a seek
        self.name = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def where(self, offset: int) -> tuple[int, int]:
        """(the index of the part holding byte `offset`, the offset within it)."""
        index = bisect.bisect_right(self.starts, offset) - 1
        return index, offset - self.starts[index]

    def readinto(self, buffer) -> int:
        if self.position >= self.size:
            return 0
        index, inner = self.where(self.position)
        kind, source, start, length = self.parts[index]
        n = min(len(buffer), length - inner, CHUNK)
        if kind == "zeros":
            buffer[:n] = bytes(n)
        elif kind == "bytes":
            buffer[:n] = source[inner:inner + n]
        else:
            handle = self._files.get(source)
            if handle is None:
                handle = self._files[source] = self._open_blob(source)
                self._file_at[source] = -1
            if self._file_at[source] != start + inner:
                handle.seek(start + inner)
            data = handle.read(n)
            if len(data) != n:
                raise OSError("a blob a span reads from is shorter than the span")
            buffer[:n] = data
            self._file_at[source] = start + inner + n
        self.position += n
        return n

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        super().close()

"""AOTInductor's C++ compiles (the wrapper's and the kernels' sources to objects), cached by content.

AOTInductor writes `<hash>.wrapper.cpp` and `<hash>.kernel.cpp` and compiles each to an object
before linking the .so, every time, even when the source is byte for byte one it compiled before
(the same method after a spec change that only touched a kernel, the other method, a rebuild on
another machine). The wrapper's compile is the longest step of a CPU compile (20 s of tiny_lm's
30 s on 2 cores). Here each such compile is looked up first by its *content*: the source's sha256
and the whole compiler command line (flags, defines, include dirs, the precompiled header it
includes, the output name), with the compile's own folder written `@DIR@` in both, plus the
compiler binary (path, size, mtime) and the torch build whose headers it includes. A hit copies
the stored object into place and runs no compiler.

What the object embeds must not depend on where the compile happened, or a hit would give other
bytes than a compile would: `-g1` line tables name the source file and the compiler's working
directory. So every compile runs in a folder named by its key (`<inductor root>/objects/<key>`:
the source copied there with its own folder's name rewritten, the command line likewise, the
working directory where torch's CppBuilder puts it), and the object a compile of that key makes is
the same whether it was compiled now, before, or on another machine with the same setup.

Objects are kept in the cudabuild cache (`objects/<key>/`, gc'd entry by entry with the other
folders beside the store, cudabuild.engine.cache_admin) and, with a shared tier, published there
and fetched from it like the Triton kernels (cudabuild.backend.shared_kernels): a record
`cpp-object:<key>` naming the object as a blob, checked on arrival. Only compiles of a single
AOTI source whose object lands beside it are taken; anything else runs as torch runs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from shutil import which
from typing import Iterator, Optional

from cudabuild.backend.toolchain import inductor_root
from cudabuild.engine.console.trace import phase
from cudabuild.engine.files import atomic_copy
from cudabuild.engine.hashing import digest, sha256_file

FOLDER = "objects"
_SOURCES = (".wrapper.cpp", ".kernel.cpp")
_HERE = "@DIR@"


@dataclass
class Counts:
    """What one compile's C++ objects were: found (here or in the shared tier) or compiled."""

    cached: int = 0
    fetched: int = 0
    compiled: int = 0


def _eligible(builder) -> Optional[tuple[str, str]]:
    """(source, object) for a compile this module takes, else None."""
    if sys.platform != "linux" or not getattr(builder, "_compile_only", False) or getattr(builder, "_use_relative_path", False):
        return None
    source, target = getattr(builder, "_sources_args", ""), builder.get_target_file_path()
    if " " in source or not source.endswith(_SOURCES) or not os.path.isfile(source):
        return None
    if os.path.dirname(target) != os.path.dirname(source):
        return None
    return source, target


def _compiler_identity(command: str) -> list:
    compiler = command.split(" ", 1)[0]
    located = compiler if os.path.isabs(compiler) else which(compiler)
    if not located:
        return [compiler]
    resolved = Path(located).resolve()
    stat = resolved.stat()
    return [str(resolved), stat.st_size, stat.st_mtime_ns]


def object_key(source: bytes, command: str) -> str:
    """The key of one compile, its folder already written as @DIR@ in `source` and `command`."""
    import torch

    return digest({"source": hashlib.sha256(source).hexdigest(), "command": command,
                   "compiler": _compiler_identity(command), "torch": [torch.__version__, torch.__file__]})


def _record_key(key: str) -> str:
    return hashlib.sha256(f"cpp-object:{key}".encode()).hexdigest()


class _Objects:
    def __init__(self, store_root: Path, tier, counts: Counts):
        self.root, self.tier, self.counts = Path(store_root) / FOLDER, tier, counts

    def build(self, original, builder) -> None:
        found = _eligible(builder)
        if found is None:
            return original(builder)
        source, target = found
        here = os.path.dirname(source)
        text = Path(source).read_bytes().replace(here.encode(), _HERE.encode())
        command = builder.get_command_line().replace(here, _HERE)
        key = object_key(text, command)
        name = os.path.basename(target)
        entry = self.root / key[:40]
        if self._take(entry / name, target):
            self.counts.cached += 1
            return None
        if self._fetch(key, entry, name) and self._take(entry / name, target):
            self.counts.fetched += 1
            return None
        if self._compile(builder, key, text, command, os.path.basename(source), name, entry):
            self.counts.compiled += 1
        else:
            self.counts.cached += 1  # another build compiled it while this one waited for the key
        if not self._take(entry / name, target):
            raise RuntimeError(f"the C++ object {name} was compiled but is not in {entry}")
        return None

    @staticmethod
    def _take(stored: Path, target: str) -> bool:
        try:
            atomic_copy(stored, Path(target))
            os.utime(stored)  # a use: gc ages entries by their files' access or change
        except OSError:
            return False
        return True

    def _compile(self, builder, key: str, text: bytes, command: str, source_name: str, name: str, entry: Path) -> bool:
        """Compile into the cache entry, in the key's own folder (one compile of a key at a time on
        this machine); False when another build stored the entry meanwhile."""
        from torch._inductor import cpp_builder

        where = Path(inductor_root()) / FOLDER / key[:40]
        where.parent.mkdir(parents=True, exist_ok=True)
        with open(where.parent / f"{key[:40]}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (entry / name).is_file():
                return False
            shutil.rmtree(where, ignore_errors=True)
            build_dir = where / f"{builder._name}_{cpp_builder._BUILD_TEMP_DIR}"
            build_dir.mkdir(parents=True)
            (where / source_name).write_bytes(text.replace(_HERE.encode(), str(where).encode()))
            cpp_builder.run_compile_cmd(command.replace(_HERE, str(where)), cwd=str(build_dir))
            self._store(where / name, entry, name)
            shutil.rmtree(where, ignore_errors=True)
        self._publish(key, entry / name, name)
        return True

    @staticmethod
    def _store(built: Path, entry: Path, name: str) -> None:
        """Into the cache as one step: the entry appears whole or not at all."""
        _publish(entry, name, lambda dest: shutil.copyfile(built, dest))

    def _fetch(self, key: str, entry: Path, name: str) -> bool:
        if self.tier is None:
            return False
        try:
            record = self.tier.get_record(_record_key(key))
            sha = (record or {}).get("outputs", {}).get(name)
            if not sha:
                return False
            entry.parent.mkdir(parents=True, exist_ok=True)
            arrived = entry.parent / f".fetch-{entry.name}-{os.getpid()}"
            if not self.tier.get_blob_to_file(sha, arrived):  # checked against sha on arrival
                return False
            _publish(entry, name, lambda dest: os.replace(arrived, dest))
            return True
        except Exception:  # the tier is an accelerator: any trouble there is a miss
            return False

    def _publish(self, key: str, stored: Path, name: str) -> None:
        tier = self.tier
        if tier is None or not tier.writable:
            return
        with contextlib.suppress(Exception):
            sha = sha256_file(stored)
            with open(stored, "rb") as source:
                if not tier.put_blob(sha, source):
                    return  # the blob first, the record last: nothing half-published
            outputs = {name: sha}
            tier.put_record(_record_key(key), {"stage": "C++ object", "digest": digest(outputs), "outputs": outputs})


@contextlib.contextmanager
def cached(store_root: Optional[Path], tier=None) -> Iterator[Counts]:
    """Within the block, AOTInductor's C++ compiles of one source go through the cache (see the
    module docstring); yields what they were. Without a `store_root`, nothing changes."""
    counts = Counts()
    if store_root is None:
        yield counts
        return
    from torch._inductor import cpp_builder

    objects = _Objects(store_root, tier, counts)
    original = cpp_builder.CppBuilder.build

    def build(builder):
        if _eligible(builder) is None:
            return original(builder)
        with phase("C++ object", min_seconds=0.05):
            return objects.build(original, builder)

    cpp_builder.CppBuilder.build = build
    try:
        yield counts
    finally:
        cpp_builder.CppBuilder.build = original


def _publish(entry: Path, name: str, place) -> None:
    """`place(path)` puts the object at `path` in a staging folder, which is then renamed to
    `entry`: the entry appears whole or not at all. Where another build published it first (the
    same bytes), the staged copy goes."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    place(staging / name)
    try:
        os.rename(staging, entry)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)

"""Which CPU vector ISAs inductor may use here, asked once per machine and toolchain, not once per compile.

Before inductor compiles any C++ (on cuda too: the wrapper's build options name a CPU ISA), it
checks each ISA that the CPU's flags list: it builds a probe library with that ISA's flags and
loads it in a child Python that imports torch. torch keeps the answer for the process only, and
every cudabuild compile runs in a fresh worker with an emptied inductor dir, so every compile
rebuilt the probes and started those children again. On the H200 that was four `python3`
children of 3.4-4.9 s each, about 16 s of each compile stage's C++ compile (trace.json's
`tool python3` spans).

The answer is only ever recorded from torch's own check. After a compile that made it, the check's
result goes into the cache (`vec_isa/<key>.json`). The key covers what decides it: the torch
build, the C++ compiler (path, size, mtime) and the CPU's flags. Where every ISA the flags list
built and loaded, a later compile sets inductor's `cpp.vec_isa_ok`. That option tells inductor to
take the flags' list as valid, which is the same list, so the compile and its bytes are what they
were. Where any ISA failed its check, compiles go on checking.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.hashing import digest

FOLDER = "vec_isa"


def _listed_by_cpu() -> list[str]:
    """The ISAs inductor would check: those whose flags the CPU has (torch's own list and test)."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def answer_key() -> Optional[str]:
    """What decides the answer here, or None where there is nothing to save (not x86-64: torch
    checks nothing by building there)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    import torch
    from torch._inductor import cpp_builder, cpu_vec_isa

    compiler = cpp_builder.get_cpp_compiler()
    located = Path(compiler) if os.path.isabs(compiler) else None
    if located is None:
        from shutil import which

        found = which(compiler)
        located = Path(found) if found else None
    stat = located.resolve().stat() if located and located.exists() else None
    return digest({
        "torch": torch.__version__, "torch_file": torch.__file__,
        "compiler": [str(located.resolve()), stat.st_size, stat.st_mtime_ns] if stat else compiler,
        "cpu_flags": sorted(cpu_vec_isa.x86_isa_checker()),
    })


def _answer_path(store_root: Path, key: str) -> Path:
    return Path(store_root) / FOLDER / f"{key[:32]}.json"


def known_answer(store_root: Path, key: str) -> Optional[dict]:
    try:
        return json.loads(_answer_path(store_root, key).read_text())
    except (OSError, ValueError):
        return None


def _record(store_root: Path, key: str) -> None:
    """Save the answer torch's check gave in this process, if this process made it."""
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0:
        return  # nothing was asked (asking now would run the very check this module saves)
    valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    listed = _listed_by_cpu()
    path = _answer_path(store_root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"listed_by_cpu": listed, "valid": valid, "all_valid": valid == listed}))


@contextlib.contextmanager
def answered(store_root: Optional[Path]) -> Iterator[Optional[bool]]:
    """Within the block, inductor skips its ISA check where the cache holds an answer in which
    every listed ISA passed. Yields whether it does (None where the machine has nothing to save),
    and records the answer after a block that made the check."""
    from torch._inductor import config as inductor_config

    if inductor_config.cpp.vec_isa_ok is not None:  # said already ($TORCHINDUCTOR_VEC_ISA_OK)
        yield None
        return
    key = answer_key() if store_root is not None else None
    if key is None:
        yield None
        return
    answer = known_answer(store_root, key)
    if answer and answer.get("all_valid") and answer.get("listed_by_cpu") == _listed_by_cpu():
        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            yield True
        return
    yield False
    with contextlib.suppress(OSError):
        _record(store_root, key)

"""Atomic writes (cudabuild.engine.files) give files the mode a plain open() would: 0666 less the umask."""

from __future__ import annotations

import os
import shutil
import stat

from conftest import assert_ok

from cudabuild.engine.files import FILE_MODE, atomic_copy, atomic_write_text

OUTPUTS = ("model.pte", "aoti_cpu_blob.ptd", "manifest.json", "trace.json")


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_atomic_write_or_copy_gets_the_umasks_mode(tmp_path):
    assert FILE_MODE == 0o666 & ~current_umask()
    atomic_write_text(tmp_path / "a.json", "{}")
    atomic_copy(tmp_path / "a.json", tmp_path / "b.json")
    assert mode(tmp_path / "a.json") == mode(tmp_path / "b.json") == FILE_MODE
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_built_and_restored_outputs_follow_the_umask_of_the_build(built_tiny, tiny_copy):
    for name in OUTPUTS:
        assert mode(built_tiny.build_dir / name) == 0o666 & ~current_umask(), name
    shutil.rmtree(tiny_copy.root / "build")
    old = os.umask(0o027)  # the build inherits it
    try:
        assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    finally:
        os.umask(old)
    assert set(tiny_copy.statuses().values()) == {"restored"}
    for name in OUTPUTS:
        assert mode(tiny_copy.build_dir / name) == 0o640, name

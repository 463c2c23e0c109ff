"""Atomic writes and copies (cudabuild.engine.files): the mode a plain open() would give (0666 less
the umask), and outputs that share no writable storage with the store."""

from __future__ import annotations

import os
import shutil
import stat

from conftest import assert_ok

from cudabuild.engine.files import FILE_MODE, atomic_copy, atomic_write_text, clone_file
from cudabuild.engine.hashing import sha256_file

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


def test_a_cloned_file_shares_no_writable_storage_with_its_source(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    how = clone_file(src, tmp_path / "dest.bin")
    assert how in ("reflink", "copy")
    assert (tmp_path / "dest.bin").read_bytes() == src.read_bytes()
    before = src.read_bytes()
    with open(tmp_path / "dest.bin", "r+b") as f:  # what a user editing build/ does
        f.write(b"edited")
        f.truncate(100)
    assert src.read_bytes() == before
    assert os.stat(src).st_ino != os.stat(tmp_path / "dest.bin").st_ino


def test_editing_a_restored_output_in_place_leaves_the_cache_intact(tiny_copy):
    """Restored outputs are copies (or reflinks), never links into the store: truncating build's
    .ptd or writing into the .pte changes nothing cached, and the next build restores both."""
    shutil.rmtree(tiny_copy.root / "build")
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    outputs = tiny_copy.manifest()["outputs"]
    with open(tiny_copy.build_dir / "aoti_cpu_blob.ptd", "r+b") as f:
        f.truncate(10)
    with open(tiny_copy.build_dir / "model.pte", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 64)
    tiny_copy.cudabuild("cache", "verify")  # exit status 1 if a blob had been damaged (and dropped)
    assert_ok(tiny_copy.export("model=tiny_lm", "target=cpu"))
    assert tiny_copy.statuses()["package"] == "restored"
    for name in ("aoti_cpu_blob.ptd", "model.pte"):
        assert sha256_file(tiny_copy.build_dir / name) == outputs[name], name

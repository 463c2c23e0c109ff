"""Mapped weights handed back to the page cache once copied (cudabuild.backend.mapped_weights)."""

from __future__ import annotations

import ctypes

import torch

from cudabuild.backend.mapped_weights import released_after_copy


def resident_file_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_a_copy_out_of_a_mapped_weight_drops_its_pages_and_keeps_its_values(tmp_path):
    size = 64 << 20
    torch.save(torch.arange(size // 4, dtype=torch.int32), tmp_path / "w.pt")
    w = torch.load(tmp_path / "w.pt", mmap=True, weights_only=True)
    expected = int(w.sum())  # touches every page: all of them resident now
    resident = resident_file_bytes()
    dest = bytearray(size)
    base = ctypes.addressof((ctypes.c_ubyte * size).from_buffer(dest))
    with released_after_copy([w]):
        ctypes.memmove(base, w.data_ptr(), size)  # as inductor fills the weights blob
    assert resident_file_bytes() < resident - size // 2
    assert bytes(dest[:8]) == w[:2].numpy().tobytes()
    assert int(w.sum()) == expected  # read back from the page cache: nothing was lost


def test_other_copies_pass_through_and_the_wrapper_is_removed(tmp_path):
    original = ctypes.memmove
    src = (ctypes.c_ubyte * 16)(*range(16))
    dst = (ctypes.c_ubyte * 16)()
    with released_after_copy([torch.zeros(4)]):
        assert ctypes.memmove is not original
        ctypes.memmove(dst, src, 16)
    assert ctypes.memmove is original
    assert list(dst) == list(range(16))

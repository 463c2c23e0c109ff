"""cudabuild.backend.cpp_objects: AOTInductor's C++ compiles cached by content, with the real
compiler: a source compiled once is taken from the cache wherever it is compiled next (its own
folder's name aside), with the same bytes and no path of either folder in them; other flags or
another source compile again; a second machine finds it through a real Redis tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_remote import server  # noqa: F401  (a real redis-server on loopback)

from cudabuild.backend import cpp_objects

pytestmark = pytest.mark.fresh_machine  # its caches start with no probe answers or C++ objects (conftest)

SOURCE = """// Triton kernels are embedded as comments in {here}/abc.wrapper.cpp
extern "C" int cudabuild_answer(int x) {{ return 6 * x + {value}; }}
"""


def build(folder: Path, *, value: int = 7, flags=("g",), name: str = "cabc.kernel") -> Path:
    """AOTInductor's way: the source in a folder of its own, compiled to an object beside it."""
    from torch._inductor.cpp_builder import CppBuilder, CppOptions

    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"{name}.cpp"
    source.write_text(SOURCE.format(here=folder, value=value))
    options = CppOptions(compile_only=True, extra_flags=tuple(f"-{f}" for f in flags))
    builder = CppBuilder(name=name, sources=str(source), output_dir=str(folder), BuildOption=options)
    builder.build()
    return Path(builder.get_target_file_path())


@pytest.fixture(autouse=True)
def inductor_root(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDABUILD_INDUCTOR_DIR", str(tmp_path / "inductor"))


def test_a_source_compiled_once_is_not_compiled_again_wherever_it_is(tmp_path):
    with cpp_objects.cached(tmp_path / "cache") as counts:
        first = build(tmp_path / "compile-a")  # -g: line tables that name the file and the folder
        second = build(tmp_path / "compile-b")
    assert (counts.compiled, counts.cached) == (1, 1)
    assert first.read_bytes() == second.read_bytes()
    assert b"compile-a" not in first.read_bytes() and b"compile-b" not in first.read_bytes()
    from cudabuild.engine.cache_admin import folder_entries

    assert len(folder_entries(tmp_path / "cache" / cpp_objects.FOLDER)) == 1  # one entry, which gc ages like kernels/

    with cpp_objects.cached(tmp_path / "cache") as counts:
        build(tmp_path / "compile-c", flags=("g", "O1"))  # other flags
        build(tmp_path / "compile-d", value=8)  # another source
    assert (counts.compiled, counts.cached) == (2, 0)


def test_without_the_cache_torch_compiles_where_it_always_did(tmp_path):
    plain = build(tmp_path / "plain")
    assert b"plain" in plain.read_bytes()  # its line tables name its own folder
    with cpp_objects.cached(tmp_path / "cache") as counts:
        build(tmp_path / "other", name="cabc")  # not an AOTInductor wrapper or kernel source
    assert (counts.compiled, counts.cached) == (0, 0)


def test_a_second_machine_takes_the_object_from_the_shared_tier(server, tmp_path):  # noqa: F811
    from cudabuild.engine.tiers.redis import RedisTier

    with cpp_objects.cached(tmp_path / "first", RedisTier(server.url)) as counts:
        first = build(tmp_path / "machine-1")
    assert counts.compiled == 1
    with cpp_objects.cached(tmp_path / "second", RedisTier(server.url)) as counts:
        second = build(tmp_path / "machine-2")
    assert (counts.compiled, counts.fetched) == (0, 1)
    assert first.read_bytes() == second.read_bytes()

"""cudabuild/engine/spans.py through the store: a file whose regions the store holds already is kept
as ranges of them, served byte for byte (streamed, materialized, restored), never when a source
is gone or changed, pinned by gc with what it reads from, and re-hashed by `cache verify`."""

from __future__ import annotations

import hashlib
import os

import pytest

from cudabuild.engine import cache_admin, spans
from cudabuild.engine.store import Store
from cudabuild.errors import CorruptBlob, MissingBlob

MiB = 1 << 20


def _bytes(seed: int, n: int) -> bytes:
    out, block = bytearray(), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:n])


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "cache")
    yield s
    s.close()


def _write(path, *pieces: bytes) -> tuple[str, list[tuple[int, int]]]:
    """A file of `pieces` back to back; its sha256 and each piece's region."""
    regions, at = [], 0
    for piece in pieces:
        regions.append((at, len(piece)))
        at += len(piece)
    data = b"".join(pieces)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest(), regions


def test_a_file_of_stored_tensors_is_kept_as_ranges_and_served_byte_for_byte(store, tmp_path):
    a, b = _bytes(1, 3 * MiB), _bytes(2, MiB + 17)
    bundle_sha, bundle_regions = _write(tmp_path / "bundle", b"HEADER" * 10, a, b)
    assert store.objects.put_file(tmp_path / "bundle", regions=bundle_regions[1:]) == bundle_sha
    assert store.objects.spans_of(bundle_sha) is None  # nothing to refer to yet: stored plainly, its regions indexed
    # Another file holding the same tensors in another order, with its own glue and padding.
    other_sha, other_regions = _write(tmp_path / "other", b"zip-header", b, b"\0" * 47, a, b"trailer")
    size = (tmp_path / "other").stat().st_size
    assert store.objects.put_file(tmp_path / "other", regions=[other_regions[1], other_regions[3]]) == other_sha
    manifest = store.objects.spans_of(other_sha)
    assert manifest is not None and manifest["size"] == size
    assert spans.referenced(manifest) == {bundle_sha}
    assert [p[0] for p in manifest["parts"]] == ["bytes", "blob", "zeros", "blob", "bytes"]
    assert store.objects.blob_bytes([other_sha]) < 4096  # its manifest, not its 4 MiB
    # Streamed, materialized for a reader that maps a path, restored into build/: the same bytes.
    assert store.objects.read_bytes(other_sha) == (tmp_path / "other").read_bytes()
    path = store.objects.verified_path(other_sha)
    assert path.read_bytes() == (tmp_path / "other").read_bytes() and path.parent.name == "spans"
    dest = store.objects.fetch(other_sha, tmp_path / "build" / "model.ptd")
    assert dest.read_bytes() == (tmp_path / "other").read_bytes() and not os.path.samefile(dest, path)
    assert store.objects.verify_blob(other_sha)


def test_a_file_whose_big_region_is_new_is_stored_plainly(store, tmp_path):
    a = _bytes(1, 2 * MiB)
    _, regions = _write(tmp_path / "first", a)
    store.objects.put_file(tmp_path / "first", regions=regions)
    sha, regions = _write(tmp_path / "second", a, _bytes(3, 2 * MiB))
    store.objects.put_file(tmp_path / "second", regions=regions)
    assert store.objects.spans_of(sha) is None and store.objects.read_bytes(sha) == (tmp_path / "second").read_bytes()


def test_a_spans_blob_whose_source_is_gone_or_changed_is_never_served(store, tmp_path):
    a = _bytes(1, 2 * MiB)
    source_sha, regions = _write(tmp_path / "source", b"x" * 100, a)
    store.objects.put_file(tmp_path / "source", regions=regions[1:])
    sha, regions = _write(tmp_path / "copy", b"y" * 50, a)
    store.objects.put_file(tmp_path / "copy", regions=regions[1:])
    assert store.objects.spans_of(sha) is not None and store.objects.has_blob(sha)
    # The source's bytes change under the store: the spans read other bytes, and are refused.
    source = store.objects.blob_path(source_sha)
    data = bytearray(source.read_bytes())
    data[-1] ^= 0xFF
    source.write_bytes(bytes(data))
    with pytest.raises(CorruptBlob):
        store.objects.fetch(sha, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not store.objects.has_blob(sha)
    # Stored again, then its source evicted: missing, not served.
    store.objects.drop_blob(source_sha)
    store.objects.put_file(tmp_path / "source", regions=[(100, len(a))])
    store.objects.put_file(tmp_path / "copy", regions=[(50, len(a))])
    assert store.objects.spans_of(sha) is not None
    store.table.evict("blob:" + source_sha)
    assert not store.objects.has_blob(sha)
    with pytest.raises(MissingBlob):
        store.objects.read_bytes(sha)


def test_gc_keeps_what_a_pinned_spans_blob_reads_from_and_verify_rehashes_it(store, tmp_path):
    a = _bytes(1, 2 * MiB)
    source_sha, regions = _write(tmp_path / "source", a)
    store.objects.put_file(tmp_path / "source", regions=regions)
    sha, regions = _write(tmp_path / "copy", b"glue" * 8, a)
    store.objects.put_file(tmp_path / "copy", regions=regions[1:])
    project = tmp_path / "project"
    stamps = project / "build" / "m" / "cpu" / ".stamps"
    stamps.mkdir(parents=True)
    (stamps / "package.json").write_text(
        '{"key": "k", "inputs": {}, "digest": "d", "outputs": {"model.ptd": "%s"}, "finals": ["model.ptd"]}' % sha)
    report = cache_admin.gc(store, project, max_bytes=0)
    assert store.objects.has_blob(sha) and store.objects.has_blob(source_sha), report.lines()
    assert cache_admin.verify(store, project).dropped == []
    stats = cache_admin.stats(store)
    assert any("kept as ranges of the others" in line for line in stats.lines(store.root))


def test_an_exported_programs_weight_files_kept_as_ranges_of_a_bundle_are_mapped_not_written_out(store, tmp_path):
    """export's weight files (torch.save archives) repeat the quantized bundle's tensors: kept as
    ranges of the bundle, and loaded by mapping those ranges, never materialized beside the store."""
    import functools

    import torch

    from cudabuild.backend.programs import archive_regions, load_program, save_program
    from _checkpoint import save_file
    from cudabuild.formats.safetensors_parts import tensor_regions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    bundle = tmp_path / "model.safetensors"
    save_file(bundle, {k: v.detach() for k, v in model.state_dict().items()})
    store.objects.put_file(bundle, regions=tensor_regions(bundle))
    ep = torch.export.export(model, (torch.randn(2, 512),))
    saved = save_program(ep, tmp_path / "export")
    assert archive_regions(saved.files["tensor.0.weight"]) == saved.regions["tensor.0.weight"]
    shas = {name: store.objects.put_file(path, saved.shas[name], saved.regions.get(name)) for name, path in saved.files.items()}
    big = shas["tensor.0.weight"]
    assert store.objects.spans_of(big) is not None and store.objects.spans_of(shas["tensor.2.bias"]) is None  # 32 bytes: glue

    read = functools.partial(lambda name: store.objects.verified_path(shas[name]))
    read.mapped = lambda name: store.objects.mapped_parts(shas[name])
    loaded = load_program(read)
    assert torch.equal(loaded.state_dict["0.weight"], model[0].weight.detach())
    x = torch.randn(2, 512)
    assert torch.allclose(loaded.module()(x), model(x))
    assert not (store.root / "spans" / big).exists()  # mapped from the bundle's own file


@pytest.mark.slow
def test_a_build_whose_blobs_are_kept_as_ranges_gives_the_same_bytes_restores_and_verifies(built_tiny, project):
    """tiny_lm's tensors are small: with regions counted from 1 KiB, its weights blobs and .ptd are
    kept as ranges of the exported weight files. The package is byte for byte the plainly stored
    build's; removed from build/, it is restored from the ranges; the cache verifies; the store
    holds less than the plain build's."""
    from conftest import assert_ok

    env = project.env(CUDABUILD_SPANS_MIN_REGION=1024)
    assert_ok(project.export("model=tiny_lm", "target=cpu", env=env))
    assert project.manifest()["outputs"] == built_tiny.manifest()["outputs"]
    store = Store(project.cache)
    try:
        kept = {stage: name for stage in ("compile.decode", "blob.decode", "package")
                for name, sha in project.stamp(stage)["outputs"].items() if store.objects.spans_of(sha) is not None}
        # The compile writes no weights blob of its own (it proves its table on AOTInductor's, in memory).
        assert kept == {"blob.decode": "weights.blob", "package": "aoti_cpu_blob.ptd"}, kept
        assert "weights.blob" not in project.stamp("compile.decode")["outputs"]
        ours = store.table.usage().get("blob", (0, 0))[1] + store.table.usage().get("spans", (0, 0))[1]
    finally:
        store.close()
    theirs = Store(built_tiny.cache)
    try:
        assert ours < theirs.table.usage()["blob"][1]
    finally:
        theirs.close()
    import shutil

    shutil.rmtree(project.build_dir)
    assert_ok(project.export("model=tiny_lm", "target=cpu", env=env))
    assert set(project.statuses().values()) == {"restored"}
    assert project.manifest()["outputs"] == built_tiny.manifest()["outputs"]
    assert project.cudabuild("cache", "verify").stdout.rstrip().endswith("intact, 0 dropped")


def test_a_file_of_many_small_constants_beside_stored_ones_keeps_its_glue_once_in_a_blob_of_its_own(store, tmp_path):
    """A 40-layer weights blob holds thousands of small constants (norms, a few KB each: megabytes
    of glue) between the big ones the store holds: its manifest moves the glue into one blob
    rather than store the file whole (which put a second 20 GB copy in the cache, 2026-12-06)."""
    big = [_bytes(i, 4 * MiB) for i in range(3)]
    bundle_sha, bundle_regions = _write(tmp_path / "bundle", *big)
    store.objects.put_file(tmp_path / "bundle", regions=bundle_regions)
    small = [_bytes(100 + i, 40 << 10) for i in range(30)]  # 1.2 MiB of glue, each under MIN_REGION
    pieces = [piece for i, b in enumerate(big) for piece in (b, *small[i * 10:(i + 1) * 10])]
    sha, regions = _write(tmp_path / "blob", *pieces)
    assert store.objects.put_file(tmp_path / "blob", regions=regions) == sha
    manifest = store.objects.spans_of(sha)
    assert manifest is not None and all(part[0] == "blob" for part in manifest["parts"])
    glue = spans.referenced(manifest) - {bundle_sha}
    assert len(glue) == 1 and store.objects.blob_bytes(glue) == 30 * (40 << 10)
    assert store.objects.read_bytes(sha) == (tmp_path / "blob").read_bytes()


def test_a_file_written_with_holes_where_the_store_holds_its_bytes_is_kept_as_their_ranges(store, tmp_path):
    """The blob stage leaves a hole where the store holds a constant's bytes (ObjectStore.holds) and
    hands put_file the regions it hashed: the file is never written whole, and reads back whole."""
    a, b = _bytes(7, 3 * MiB), _bytes(8, MiB)
    _, regions = _write(tmp_path / "bundle", a, b)
    store.objects.put_file(tmp_path / "bundle", regions=regions)
    data = b"head" + a + b"mid" + b
    sha = hashlib.sha256(data).hexdigest()
    digested = [(4, len(a), hashlib.sha256(a).hexdigest()), (7 + len(a), len(b), hashlib.sha256(b).hexdigest())]
    assert all(store.objects.holds(d, n) for _, n, d in digested)
    with open(tmp_path / "sparse", "wb") as f:
        f.write(b"head")
        f.seek(4 + len(a))
        f.write(b"mid")
        f.truncate(len(data))
    assert store.objects.put_file(tmp_path / "sparse", sha, digested) == sha
    assert store.objects.spans_of(sha) is not None and store.objects.read_bytes(sha) == data

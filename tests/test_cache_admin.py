"""cudabuild.engine.cache_admin: sizes, enforce_limit, stats over real logged builds, gc that keeps
what build/ references, and verify that finds a damaged blob (see _fixtures_cli for the builds)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from _fixtures_cli import BUILD, scripted_builds, tiny_lm_build
from cudabuild.cli import main
from cudabuild.engine import cache_admin
from cudabuild.errors import InvalidOption
from cudabuild.engine.stamp import Stamp
from cudabuild.engine.store import Store

MiB = 2**20


@pytest.mark.parametrize("text, size", [
    ("123456", 123456), ("500M", 500 * 10**6), ("2G", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30)),
    ("10k", 10_000), ("1 MiB", MiB), ("3mb", 3 * 10**6), ("64B", 64), ("2Ti", 2 * 2**40),
])
def test_parse_size_accepts_suffixes(text, size):
    assert cache_admin.parse_size(text) == size


@pytest.mark.parametrize("text", ["5X", "", "-1", "G", "1.2.3M", "M5"])
def test_parse_size_rejects_with_one_actionable_line(text):
    with pytest.raises(InvalidOption, match=r"^--max-size '.*' is not a size; use bytes or a number with K, M, G, T"):
        cache_admin.parse_size(text, "--max-size")


def test_format_bytes():
    assert [cache_admin.format_bytes(n) for n in (512, 1536, 5 * MiB, 3 * 2**30)] == ["512 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]


def stats_rows(text: str) -> dict[str, tuple[int, int, int]]:
    """{stage kind: (hits, restores, misses)} from `cudabuild cache stats`."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\s+(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+%", line)
        if m:
            rows[m[1]] = tuple(int(x) for x in m.group(2, 3, 4))
    return rows


@pytest.mark.slow
def test_stats_count_what_the_scripted_builds_did(tmp_path_factory):
    # Builds: full (14 ran), no-op (14 cached), decode spec change (compile.decode, blob.decode,
    # package, verify.decode ran; 10 cached), rm -rf build + rebuild (14 restored).
    scripted = scripted_builds(tmp_path_factory)
    out = scripted.cudabuild("cache", "stats", "--last", "4").stdout
    rows = stats_rows(out)
    assert rows["probe"] == (2, 1, 1)
    assert rows["compile"] == (3, 2, 3)
    assert rows["package"] == (1, 1, 2)
    assert rows["all"] == (24, 14, 18)
    saved_seconds, saved_mib = re.search(r"without running them: ([\d.]+)s of run time and ([\d.]+) MiB", out).groups()
    assert float(saved_seconds) > 1 and float(saved_mib) > 1
    assert re.match(r"cache .*: \d+ blobs [\d.]+ MiB, \d+ records", out)
    assert stats_rows(scripted.cudabuild("cache", "stats", "--last", "1").stdout)["all"] == (0, 14, 0)


def plant(store: Store, count: int, size: int) -> list[str]:
    """Unpinned blobs, least recently used first (access times a little apart)."""
    shas = []
    for _ in range(count):
        shas.append(store.objects.put_bytes(os.urandom(size)))
        time.sleep(0.01)
    return shas


@pytest.mark.slow
def test_gc_evicts_least_recently_used_and_keeps_what_build_references(tmp_path_factory, tmp_path):
    clone = tiny_lm_build(tmp_path_factory).copy(tmp_path)
    pins = cache_admin.pins(clone.root)
    store = Store(clone.cache)
    try:
        assert all(pins.holds(e.key) for e in store.table.entries("blob:")), "a single build pins every blob"
        oldest, middle, newest = plant(store, 3, MiB)
        store.objects.read_bytes(oldest)  # used again: now the most recently used
        store.actions.put_record("planted", {"stage": "export.x", "digest": "d", "outputs": {"p": middle}})
        limit = store.table.size() - MiB - MiB // 2
        report = cache_admin.gc(store, clone.root, max_bytes=limit)
        assert (report.evicted_blobs, store.objects.has_blob(middle), store.objects.has_blob(newest), store.objects.has_blob(oldest)) == (2, False, False, True)
        assert report.dangling_records == 1 and store.actions.local_record("planted") is None
        assert store.table.size() <= limit
        assert all(store.objects.has_blob(sha) for sha in pins.blobs) and all(store.actions.local_record(k) for k in pins.keys)
    finally:
        store.close()
    # Far below what build/ references: only unpinned entries go, and the build stays a no-op.
    out = clone.cudabuild("cache", "gc", "--max-size", "1").stdout
    assert "evicted 1 blob and 0 records" in out and "note: what build/ references alone is over the limit" in out
    assert set(clone.explain().values()) == {"up to date"}
    summary = clone.run("-m", "doit", "export", *BUILD).stdout
    assert "ran 0, restored 0, cached 14" in summary


def test_gc_dry_run_changes_nothing_and_reports_what_gc_then_does(tmp_path, monkeypatch, capsys):
    # No build needed: one stamp under build/ pins a blob and its record, the rest is planted.
    monkeypatch.delenv("CUDABUILD_REMOTE", raising=False)
    monkeypatch.setenv("CUDABUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDABUILD_PROJECT", str(tmp_path / "project"))
    store = Store(tmp_path / "cache")
    try:
        pinned = store.objects.put_bytes(os.urandom(MiB))
        store.actions.put_record("pinned", {"stage": "package", "digest": "d", "outputs": {"model.pte": pinned}})
        stamps = tmp_path / "project" / "build" / "m" / "cpu" / ".stamps"
        stamps.mkdir(parents=True)
        Stamp(key="pinned", inputs={}, digest="d", outputs={"model.pte": pinned}).save(stamps / "package.json")
        oldest, middle, newest = plant(store, 3, MiB)
        store.actions.put_record("names-middle", {"stage": "export.x", "digest": "d", "outputs": {"p": middle}})
        orphan = Path(store.table.cache.directory) / "0f" / "0f" / "killed-write.val"  # diskcache's layout
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"x" * 1000)
        os.utime(orphan, (time.time() - 7200, time.time() - 7200))
        limit = store.table.size() - MiB - MiB // 2  # two of the three planted blobs must go

        def contents():
            return sorted(store.table.entries("blob:") + store.table.entries("rec:")), orphan.exists()

        before = contents()
        would = cache_admin.gc(store, tmp_path / "project", max_bytes=limit, dry_run=True)
        assert contents() == before, "a dry run evicts, drops and deletes nothing, and uses no entry"
        assert main(["cache", "gc", "--dry-run", "--max-size", str(limit)]) == 0
        assert capsys.readouterr().out.splitlines() == would.lines()
        assert contents() == before

        did = cache_admin.gc(store, tmp_path / "project", max_bytes=limit)
        assert dataclasses.replace(would, dry_run=False) == did
        assert (did.evicted_blobs, did.evicted_records, did.dangling_records, did.orphan_files) == (2, 0, 1, 1)
        assert [store.objects.has_blob(sha) for sha in (pinned, oldest, middle, newest)] == [True, False, False, True]
        assert store.actions.local_record("names-middle") is None and not orphan.exists() and did.size_after == store.table.size()
    finally:
        store.close()
    assert would.lines()[0].startswith("would evict 2 blobs and 0 records (2.0 MiB), least recently used first; "
                                       "would drop 1 record left without their blobs")
    assert would.lines()[1].startswith("store would be ") and "; would keep 1 blob (1.0 MiB) that 1 stamp" in would.lines()[1]
    assert would.lines()[2] == "would delete 1 orphaned file (1000 B) that killed cache writes left behind"
    assert did.lines()[0].startswith("evicted 2 blobs and 0 records (2.0 MiB), least recently used first; dropped 1 record")
    assert did.lines()[2] == "deleted 1 orphaned file (1000 B) that killed cache writes left behind"


@pytest.mark.slow
def test_gc_max_age_and_enforce_limit_spare_pinned_entries(tmp_path_factory, tmp_path, monkeypatch):
    clone = tiny_lm_build(tmp_path_factory).copy(tmp_path)
    pins = cache_admin.pins(clone.root)
    store = Store(clone.cache)
    try:
        (planted,) = plant(store, 1, 1000)
        assert cache_admin.gc(store, clone.root, max_age_days=1).evicted_blobs == 0  # used just now
        assert cache_admin.gc(store, clone.root, max_age_days=0).evicted_blobs == 1
        assert not store.objects.has_blob(planted)

        pinned_bytes = store.table.size()
        plant(store, 3, MiB)
        monkeypatch.delenv("CUDABUILD_CACHE_MAX_SIZE", raising=False)
        assert cache_admin.enforce_limit(store, clone.root) is None and store.table.size() > pinned_bytes + 3 * MiB - 1
        monkeypatch.setenv("CUDABUILD_CACHE_MAX_SIZE", str(pinned_bytes + 2 * MiB))
        report = cache_admin.enforce_limit(store, clone.root)
        assert report.evicted_blobs == 1 and store.table.size() <= pinned_bytes + 2 * MiB
        assert cache_admin.enforce_limit(store, clone.root) is None  # under the limit now: nothing to do
        monkeypatch.setenv("CUDABUILD_CACHE_MAX_SIZE", "0")
        cache_admin.enforce_limit(store, clone.root)
        assert store.table.size() == pinned_bytes and all(store.objects.has_blob(sha) for sha in pins.blobs)
        monkeypatch.setenv("CUDABUILD_CACHE_MAX_SIZE", "lots")
        with pytest.raises(InvalidOption, match="^CUDABUILD_CACHE_MAX_SIZE 'lots' is not a size"):
            cache_admin.enforce_limit(store, clone.root)
    finally:
        store.close()


@pytest.mark.slow
def test_verify_drops_a_corrupt_blob_and_the_records_that_named_it(tmp_path_factory, tmp_path):
    clone = tiny_lm_build(tmp_path_factory).copy(tmp_path)
    edge = clone.stamp("edge.decode")
    corrupt = edge["outputs"]["graph.json"]
    gone = clone.stamp("compile.prefill")["outputs"]["compile.json"]
    store = Store(clone.cache)
    try:
        path = store.objects.blob_path(corrupt)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        store.objects.blob_path(gone).unlink()
    finally:
        store.close()

    done = clone.cudabuild("cache", "verify", check=False)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert re.match(r"re-hashed \d+ blobs \([\d.]+ MiB\): \d+ intact, 2 dropped", lines[0])
    assert f"{corrupt[:12]} (edge.decode graph.json)" in lines[0] and f"{gone[:12]} (compile.prefill compile.json)" in lines[0]
    assert lines[1].startswith("dropped 2 records that named a missing blob: ")
    assert "edge.decode" in lines[1] and "compile.prefill" in lines[1]
    assert lines[2].startswith("stamps under build/ naming a blob this cache lacks: tiny_lm/cpu/compile.prefill, tiny_lm/cpu/edge.decode ")

    store = Store(clone.cache)
    try:
        assert not store.objects.has_blob(corrupt) and not store.objects.has_blob(gone)
        assert store.actions.local_record(edge["key"]) is None
    finally:
        store.close()
    again = clone.cudabuild("cache", "verify")
    assert again.returncode == 0 and "0 dropped" in again.stdout


def test_stats_count_the_folders_stages_keep_beside_the_store(tmp_path):
    # The compile's shared Triton kernels (cudabuild.backend.kernel_cache) live in <cache>/kernels.
    from cudabuild.engine import cache_admin
    from cudabuild.engine.store import Store

    store = Store(tmp_path / "cache")
    kernels = tmp_path / "cache" / "kernels" / "triton" / "ab12"
    kernels.mkdir(parents=True)
    (kernels / "k.cubin").write_bytes(b"x" * 3000)
    (kernels / "k.json").write_text("{}")
    lines = cache_admin.stats(store).lines(store.root)
    assert lines[1] == "beside it: kernels/ 2 files 2.9 KiB"


def test_gc_evicts_compiled_kernels_beside_the_store_by_age_and_first_under_a_limit(tmp_path, monkeypatch):
    """The kernel cache (kernels/triton/<hash>/, Triton's layout) is gc'd entry by entry: an entry
    not used within the age goes, and under a size limit kernels go before any blob; `cache stats`
    counts what is left."""
    store = Store(tmp_path / "cache")
    try:
        blob = store.objects.put_bytes(os.urandom(MiB))
        store.actions.put_record("k", {"stage": "export.x", "digest": "d", "outputs": {"p": blob}})
        kernels = tmp_path / "cache" / "kernels" / "triton"
        ages = {"stale": 10 * 86400, "older": 3600, "newer": 60}
        for name, age in ages.items():
            (kernels / name).mkdir(parents=True)
            for part in ("k.cubin", "__grp__k.json"):
                (kernels / name / part).write_bytes(os.urandom(40_000))
                os.utime(kernels / name / part, (time.time() - age, time.time() - age))
        project = tmp_path / "project"

        would = cache_admin.gc(store, project, max_age_days=1, dry_run=True)
        assert sorted(p.name for p in kernels.iterdir()) == ["newer", "older", "stale"]
        assert cache_admin.gc(store, project, max_age_days=1) == dataclasses.replace(would, dry_run=False)
        assert sorted(p.name for p in kernels.iterdir()) == ["newer", "older"]
        line = f"would evict 1 entry ({cache_admin.format_bytes(80_000)}) of kernels/ beside the store, least recently used first"
        assert line in would.lines(), would.lines()

        # A limit that the store and one kernel fit under: the older kernel goes, no blob does.
        limit = store.table.size() + 80_000 + 1000
        report = cache_admin.gc(store, project, max_bytes=limit)
        assert report.evicted_beside == {"kernels": (1, 80_000)} and report.evicted_blobs == 0
        assert [p.name for p in kernels.iterdir()] == ["newer"] and store.objects.has_blob(blob)
        assert cache_admin.stats(store).folders == {"kernels": (2, 80_000)}

        # The limit a build enforces after each stage bounds the store alone: it leaves the kernels.
        monkeypatch.setenv(cache_admin.MAX_SIZE_ENV, str(store.table.size() - 1))
        enforced = cache_admin.enforce_limit(store, project)
        assert enforced.evicted_blobs == 1 and enforced.evicted_beside == {}
        assert [p.name for p in kernels.iterdir()] == ["newer"]
    finally:
        store.close()


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped): what a killed stage's folder names."""
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_stats_and_gc_agree_on_the_work_folders_killed_stages_left_and_spare_running_ones(tmp_path, monkeypatch, capsys):
    """Issue 59: after a Ctrl-C, `cache stats` said `work/ 0 files 0 B` while `cache gc --dry-run`
    said it would delete 2 work folders. Both count the folders now; gc deletes a killed stage's
    folder only, and never a running stage's, whatever the limit (it used to evict a running
    stage's files as a folder beside the store)."""
    monkeypatch.delenv("CUDABUILD_REMOTE", raising=False)
    monkeypatch.setenv("CUDABUILD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "project").mkdir()  # the settings' check wants an existing project folder
    monkeypatch.setenv("CUDABUILD_PROJECT", str(tmp_path / "project"))
    store = Store(tmp_path / "cache")
    try:
        work = tmp_path / "cache" / "work"
        killed = [work / f"compile.decode-{_dead_pid()}-ab12cd34", work / f"export.text-decoder-{_dead_pid()}-x_9"]
        for folder in killed:
            folder.mkdir(parents=True)  # empty, as an interrupted compile leaves its folder
        with store.objects.work_folder("blob.decode") as running:
            (running / "weights.blob").write_bytes(b"x" * 5000)
            lines = cache_admin.stats(store).lines(store.root)
            assert "work/: 2 folders (0 B) that killed stages left behind; the next build or `cudabuild cache gc` " \
                   "deletes them" in lines, lines
            assert "work/: 1 folder (4.9 KiB) of stages running now" in lines, lines
            assert not any(line.startswith("beside it: work/") for line in lines), lines
            assert main(["cache", "gc", "--dry-run", "--max-size", "1"]) == 0
            assert "would delete 2 work folders (0 B) that killed stages left behind" in capsys.readouterr().out
            report = cache_admin.gc(store, tmp_path / "project", max_bytes=0)
            assert (report.work_folders, report.evicted_beside) == (2, {})
            assert not any(folder.exists() for folder in killed)
            assert (running / "weights.blob").read_bytes() == b"x" * 5000
        assert not [line for line in cache_admin.stats(store).lines(store.root) if "work/" in line]
    finally:
        store.close()

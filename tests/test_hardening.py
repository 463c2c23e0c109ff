"""Faults a build must survive without ever serving a wrong artifact (issue 7): SIGKILL in each stage
and in the middle of a cache write, concurrent builds, damaged blobs, a full disk, a damaged
`.doit.db`, and bad input that must end in one line. Real processes, signals and files throughout
(see _faults.py); "a clean build" is the session's `built_tiny`, whose CPU outputs are deterministic.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from _faults import (
    BUILD_ARGS, COMPILERS, assert_cache_verifies, assert_same_outputs, blob_file, build_dir, forget, killed_by_hook,
    kill_when, one_error_line, orphan_blob_files, processes_marked, sha, signal_when, stage_running_for, stamp,
    start_export, tmpfs,
)
from conftest import Project, assert_ok, new_project

from cudabuild.engine.cache_admin import format_bytes
from cudabuild.engine.store import Store

REBUILD_TIMEOUT = 600


def rebuild(project: Project) -> dict[str, str]:
    assert_ok(project.export(*BUILD_ARGS, timeout=REBUILD_TIMEOUT))
    return project.statuses()


def records(project: Project) -> dict[str, str]:
    """{action key: stage} of every record in the project's cache."""
    store = Store(project.cache)
    try:
        return {key: record["stage"] for key, record in store.actions.records()}
    finally:
        store.close()


# -- SIGKILL ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage, after", [
    pytest.param("trace.decode", 0.3, id="trace"),
    pytest.param("edge.prefill", 0.5, id="edge"),
    pytest.param("compile.prefill", 3.0, id="compile"),
    pytest.param("package", 0.5, id="package"),
    pytest.param("verify.decode", 0.0, id="verify"),
])
def test_sigkill_during_a_stage_then_rebuild_matches_a_clean_build(built_tiny, tiny_copy, tmp_path, stage, after):
    forget(tiny_copy, stage)
    workdirs = tiny_copy.cache / "work"  # the stages' work folders, beside the cache
    build = start_export(tiny_copy, tmp_path / "killed.log")
    assert kill_when(build, stage_running_for(workdirs, stage, after)), build.output()[-3000:]
    assert not (build_dir(tiny_copy) / ".stamps" / f"{stage}.json").exists(), "the kill came after the stage ended"
    assert stage not in records(tiny_copy).values()

    assert list(workdirs.iterdir()), "the killed stage left no work folder"
    statuses = rebuild(tiny_copy)
    assert statuses[stage] == "ran"
    assert not list(workdirs.iterdir()), "the next build left the killed stage's work folder"
    assert_same_outputs(tiny_copy, built_tiny)
    if stage.startswith("compile"):
        # A fresh compile with the same key gives the same bytes, so nothing downstream reruns.
        assert stamp(tiny_copy, stage)["outputs"] == stamp(built_tiny, stage)["outputs"]
        assert statuses["package"] == statuses["verify.prefill"] == "cached"
    assert_cache_verifies(tiny_copy)


@pytest.mark.slow
def test_ctrl_c_mid_compile_is_one_line_ends_every_process_and_the_rerun_resumes(built_tiny, tiny_copy, tmp_path):
    """SIGINT to the build's process group (what Ctrl-C sends) while a compiler runs, in the default
    setup of a 2-core machine (two workers, stages served by a warm process): exit status 130, one
    line on stderr and no traceback, and once the command has returned no process of the build is
    left (doit's workers, compilers, the warm process's call; the warm process itself stays, as it
    does after every build). The next build resumes and gives the clean build's bytes."""
    forget(tiny_copy, "compile.decode", "compile.prefill")
    mark = f"CUDABUILD_TEST_INTERRUPT={tmp_path}"  # in the environment of everything this build starts
    name, value = mark.split("=", 1)
    errors = tmp_path / "stderr"
    build = start_export(tiny_copy, tmp_path / "stdout", errors=errors, CUDABUILD_JOBS=2, CUDABUILD_WARM=1,
                         CUDABUILD_WARM_IDLE_SECONDS=60, **{name: value})
    try:
        compiling = lambda: any(p.program in COMPILERS for p in processes_marked(mark))  # noqa: E731
        assert signal_when(build, compiling, signal.SIGINT), build.output()[-3000:]
        assert build.wait() == 130, build.output()[-3000:] + errors.read_text()
        left = processes_marked(mark)  # the moment the command returned
        work_left = list((tiny_copy.cache / "work").iterdir())  # each interrupted stage removes its own
        said = errors.read_text().splitlines()
        explained = tiny_copy.cudabuild("explain", "model=tiny_lm", "target=cpu").stdout.splitlines()[1:]
        up_to_date = [line for line in explained if line.split(None, 1)[1].startswith("up to date")]
    finally:
        tiny_copy.cudabuild("warm", "stop", check=False)

    assert said == [f"cudabuild: interrupted; {len(up_to_date)} of {len(explained)} stages are done and kept, the next build resumes "
                    "from there"], (said, explained)
    assert "Traceback" not in build.output()
    pids = {p.pid: p for p in left}
    serving = [p for p in left if p.ppid in pids and "--worker" in pids[p.ppid].argv]  # a warm call's process
    assert [p for p in left if "warm_server.py" not in " ".join(p.argv)] == [] and serving == [], left
    assert work_left == []

    statuses = rebuild(tiny_copy)  # the compile that was interrupted runs; what was done is not done again
    assert "ran" in (statuses["compile.decode"], statuses["compile.prefill"]) and statuses["edge.decode"] == "cached"
    assert_same_outputs(tiny_copy, built_tiny)


@pytest.mark.slow
def test_sigkill_while_a_stage_stores_its_outputs_then_rebuild_matches_a_clean_build(built_tiny, tiny_copy, tmp_path):
    # Without its blobs in the store, package must write them again. The build kills itself (see
    # _kill_hook) right after diskcache wrote the first one's file, before that file's row commits.
    forget(tiny_copy, "package", blobs=("model.pte", "aoti_cpu_blob.ptd"))
    assert not orphan_blob_files(tiny_copy)
    build = start_export(tiny_copy, tmp_path / "killed.log", kill_hook=True, TMPDIR=tmp_path)  # its workdir stays here
    key, filename = killed_by_hook(build)

    assert not (build_dir(tiny_copy) / ".stamps" / "package.json").exists(), "the kill came after package ended"
    assert "package" not in records(tiny_copy).values()
    # The file was complete, and no row names it: the blob is absent, its file an orphan.
    orphan = tiny_copy.cache / "store" / filename
    assert key.removeprefix("blob:") in stamp(built_tiny, "package")["outputs"].values(), key
    assert orphan_blob_files(tiny_copy) == {orphan}
    assert sha(orphan) == key.removeprefix("blob:")
    store = Store(tiny_copy.cache)
    try:
        assert not store.objects.has_blob(key.removeprefix("blob:"))
    finally:
        store.close()

    statuses = rebuild(tiny_copy)
    assert statuses["package"] == "ran"
    assert_same_outputs(tiny_copy, built_tiny)
    assert_cache_verifies(tiny_copy)

    # The orphan is never served, only swept: gc leaves a fresh one (it could be a write about to
    # commit) and deletes it once it is an hour old.
    assert orphan_blob_files(tiny_copy) == {orphan}
    assert "orphaned" not in cache_gc(tiny_copy)
    hour_ago = time.time() - 3700
    os.utime(orphan, (hour_ago, hour_ago))
    assert f"deleted 1 orphaned file ({format_bytes(orphan.stat().st_size)}) that killed cache writes left behind" in cache_gc(tiny_copy)
    assert not orphan.exists() and not orphan_blob_files(tiny_copy)
    assert_cache_verifies(tiny_copy)


def cache_gc(project: Project) -> str:
    """`cudabuild cache gc` with limits that evict nothing here; its output."""
    result = subprocess.run([sys.executable, "-m", "cudabuild", "cache", "gc", "--max-age", "3650"], cwd=project.root,
                            env=project.env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "evicted 0 blobs and 0 records" in result.stdout, result.stdout + result.stderr
    return result.stdout


_PUT = ("import sys; from cudabuild.engine.store import Store; s = Store(sys.argv[1]); print('open', flush=True); input(); "
        "s.objects.put_file(sys.argv[2], sha=sys.argv[3])")


@pytest.mark.parametrize("moment", ["mid-file", "before-commit"])
def test_sigkill_during_a_cache_write_leaves_no_entry(tmp_path, moment):
    """A writer killed while diskcache writes a blob's file, or after the file and before its row
    commits, leaves at most a file no row names: the blob is absent, and stores and reads fine later."""
    data = os.urandom(6 << 20)
    digest = hashlib.sha256(data).hexdigest()
    root, source = tmp_path / "cache", tmp_path / "blob"
    Store(root).close()

    def sizes() -> list[int]:
        return [p.stat().st_size for p in (root / "store").rglob("*.val")]

    # mid-file: the writer reads 5 of 6 MiB from a FIFO and waits for the rest, 4 MiB into its file;
    # before-commit: it writes the whole file, then waits for the transaction we hold to end.
    needed = 4 << 20 if moment == "mid-file" else len(data)
    if moment == "mid-file":
        os.mkfifo(source)
    else:
        source.write_bytes(data)
    writer = subprocess.Popen([sys.executable, "-c", _PUT, str(root), str(source), digest], cwd=tmp_path,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdout.readline() == b"open\n"  # opening the store writes too: lock only after it
    lock = sqlite3.connect(root / "store" / "cache.db", timeout=60, isolation_level=None)
    fifo = None
    try:
        if moment == "before-commit":
            lock.execute("BEGIN IMMEDIATE")  # the writer's row must wait for this transaction
        writer.stdin.write(b"go\n")
        writer.stdin.close()
        if moment == "mid-file":
            fifo = open(source, "wb")  # opens once the writer opens its end
            fifo.write(data[: 5 << 20])
            fifo.flush()
        deadline = time.monotonic() + 600
        while not any(size >= needed for size in sizes()):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never got to the moment"
            time.sleep(0.01)
        writer.send_signal(signal.SIGKILL)
        assert writer.wait() == -signal.SIGKILL
    finally:
        if moment == "before-commit":
            lock.execute("ROLLBACK")
        lock.close()
        if fifo is not None:
            fifo.close()

    assert sizes(), "the kill came before diskcache wrote anything"
    store = Store(root)
    try:
        assert not store.objects.has_blob(digest) and not store.table.entries("blob:")
        assert store.objects.put_bytes(data) == digest
        assert store.objects.read_bytes(digest) == data
    finally:
        store.close()


# -- concurrent builds --------------------------------------------------------------------------


def _started_together(*runs):
    builds = [start_export(project, log, *args) for project, log, args in runs]
    for build in builds:
        assert build.wait() == 0, build.output()[-3000:]


def _compile_statuses(project: Project, key: str, last: int) -> list[str]:
    """Statuses of the stage with action `key` in the last builds logged in the project's cache."""
    store = Store(project.cache)
    try:
        return sorted(s["status"] for entry in store.actions.build_log(last) for s in entry["stages"] if s["key"] == key)
    finally:
        store.close()


@pytest.mark.slow
def test_two_builds_of_one_project_at_once_compile_each_key_once(built_tiny, tiny_copy, tmp_path):
    forget(tiny_copy, "compile.prefill")
    _started_together((tiny_copy, tmp_path / "a.log", BUILD_ARGS), (tiny_copy, tmp_path / "b.log", BUILD_ARGS))
    key = stamp(tiny_copy, "compile.prefill")["key"]
    statuses = _compile_statuses(tiny_copy, key, last=2)
    assert statuses in (["ran", "restored"], ["cached", "ran"]), statuses  # exactly one of them compiled it
    assert_same_outputs(tiny_copy, built_tiny)
    # Both wrote doit's database at once; the next build still reads it, and has nothing to do.
    assert set(rebuild(tiny_copy).values()) == {"cached"}


@pytest.mark.slow
def test_two_projects_and_models_sharing_a_cache_compile_each_key_once(built_tiny, tiny_copy, tmp_path):
    # tiny_twin is tiny_lm under another name: a different model (its own export keys) whose graphs,
    # hence edge, compile and package keys, are tiny_lm's. Both builds need compile.prefill.
    forget(tiny_copy, "compile.prefill")
    other = Project(new_project(tmp_path / "other").root, tiny_copy.cache)
    shutil.copy(other.root / "recipes" / "tiny_lm.py", other.root / "recipes" / "tiny_twin.py")
    _started_together((tiny_copy, tmp_path / "a.log", BUILD_ARGS),
                      (other, tmp_path / "b.log", ("model=tiny_twin", "target=cpu")))
    mine, theirs = tiny_copy.manifest(), other.manifest("tiny_twin")
    compiles = [next(s for s in manifest["stages"] if s["stage"] == "compile" and s["method"] == "prefill")
                for manifest in (mine, theirs)]
    assert compiles[0]["key"] == compiles[1]["key"]
    assert sorted(c["status"] for c in compiles) == ["ran", "restored"]
    assert_same_outputs(tiny_copy, built_tiny)
    assert theirs["outputs"] == built_tiny.manifest()["outputs"]


@pytest.mark.slow
def test_two_caches_on_one_machine_compile_one_key_in_turn(built_tiny, tiny_copy, tmp_path):
    # Separate caches share no key lock, but do share the compile's inductor dir (named by the key).
    second = built_tiny.copy(tmp_path / "second")
    for project in (tiny_copy, second):
        forget(project, "compile.prefill")
    _started_together((tiny_copy, tmp_path / "a.log", BUILD_ARGS), (second, tmp_path / "b.log", BUILD_ARGS))
    for project in (tiny_copy, second):
        assert project.statuses()["compile.prefill"] == "ran"
        assert_same_outputs(project, built_tiny)


# -- damaged cache entries ----------------------------------------------------------------------


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "file-deleted-row-kept", "record-names-missing-blob"])
def test_damaged_blob_is_detected_dropped_and_rebuilt(built_tiny, tiny_copy, damage):
    if damage in ("flipped-byte", "record-names-missing-blob"):
        # A final output: found when restoring build/ from the store.
        producer, blob = "package", stamp(tiny_copy, "package")["outputs"]["model.pte"]
        if damage == "flipped-byte":
            _flip_a_byte(blob_file(tiny_copy, blob))
        else:
            store = Store(tiny_copy.cache)
            store.objects.drop_blob(blob)
            store.close()
        shutil.rmtree(tiny_copy.root / "build")
    else:
        # An intermediate: found when a stage that runs reads it (edge reads export's program).
        producer, blob = "export.decode", stamp(tiny_copy, "export.decode")["outputs"]["program.json"]
        path = blob_file(tiny_copy, blob)
        if damage == "truncated":
            _truncate(path)
        else:
            path.unlink()
        forget(tiny_copy, "edge.decode")

    result = tiny_copy.export(*BUILD_ARGS, timeout=REBUILD_TIMEOUT)
    assert_ok(result)
    assert tiny_copy.statuses()[producer] == "ran"
    if damage in ("flipped-byte", "truncated"):
        # A warning on stderr, where cudabuild's warnings go (the console, not the stage's log).
        assert f"cudabuild: warning: cached blob {blob[:12]}" in result.stderr and "failed its sha256 check" in result.stderr
    assert_same_outputs(tiny_copy, built_tiny)
    assert_cache_verifies(tiny_copy)


# -- a full disk --------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, built_tiny):
    """A tmpfs a little larger than the built cache (needs root and permission to mount)."""
    size = sum(p.stat().st_size for p in built_tiny.cache.rglob("*") if p.is_file()) + (4 << 20)
    yield from tmpfs(tmp_path / "disk", size)


@pytest.mark.slow
@pytest.mark.parametrize("room", [0, 300_000], ids=["no-room-to-open", "room-for-some-blobs"])
def test_full_disk_fails_in_one_line_and_a_build_with_room_succeeds(built_tiny, tiny_copy, small_disk, room):
    project = Project(tiny_copy.root, small_disk / "cache")
    shutil.copytree(tiny_copy.cache, project.cache)
    recipe = project.root / "recipes" / "tiny_lm.py"  # a statement that moves every line: export writes new blobs
    recipe.write_text(recipe.read_text().replace("from __future__ import annotations\n",
                                                 "from __future__ import annotations\n\nMOVED_DOWN_A_LINE = 1\n", 1))
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(max(shutil.disk_usage(small_disk).free - room, 0)))

    line = one_error_line(project.export(*BUILD_ARGS, timeout=REBUILD_TIMEOUT))
    assert f"cannot write to the cache at {project.cache} while " in line, line
    assert "disk is full" in line or "No space left on device" in line, line

    filler.unlink()
    statuses = rebuild(project)  # trace.decode may have been stored before the disk filled up
    assert {k for k, s in statuses.items() if s != "cached"} <= {"trace.decode", "trace.prefill", "export.decode",
                                                                  "export.prefill"}, statuses
    assert "ran" in statuses.values(), statuses
    assert_same_outputs(project, built_tiny)
    assert_cache_verifies(project)


@pytest.fixture
def twelve_mb_disk(tmp_path):
    yield from tmpfs(tmp_path / "disk", 12 << 20)


@pytest.mark.slow
def test_a_first_build_on_a_12_mb_disk_names_the_full_disk_in_every_stage_it_stops(project, tmp_path, twelve_mb_disk):
    """Issue 59: a tiny_lm build with its cache on a 12 MB tmpfs, two stages at once. compile.prefill
    met the disk in its move of the .so into the cache and then again in the admission's ledger,
    and blob.decode in storing its blob: both said a bare `OSError: [Errno 28]`. Every stage that
    stops says which disk filled and what to do, in the cache writer's words."""
    cache = twelve_mb_disk / "cache"
    small = Project(project.root, cache)
    done = small.export(*BUILD_ARGS, env=small.env(CUDABUILD_JOBS=2), timeout=REBUILD_TIMEOUT)
    text = done.stdout + done.stderr
    errors = [line for line in text.splitlines() if line.startswith("cudabuild: error:")]
    assert done.returncode != 0 and errors, text[-3000:]
    for line in errors:
        stage = line.split("]", 1)[0].removeprefix("cudabuild: error: [")
        assert line.endswith(f"] cannot write to the cache at {cache} while running stage {stage}: its disk is full (No "
                             "space left on device); free space there (cudabuild cache gc --max-size SIZE) or set "
                             "CUDABUILD_CACHE_DIR to a disk with room"), text[-3000:]
    assert "Traceback" not in text and "OSError" not in text, text[-3000:]
    # What was stored before the disk filled is whole: nothing half-written is served.
    shutil.copytree(cache, tmp_path / "roomy", symlinks=True)
    assert_cache_verifies(Project(project.root, tmp_path / "roomy"))


# -- doit's database ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["deleted", "garbage", "garbage-and-build-wiped", "garbage-of-another-format"])
def test_damaged_doit_db_is_rebuilt_from_the_store(built_tiny, tiny_copy, damage):
    dbs = sorted(tiny_copy.root.glob(".doit.db*"))
    assert dbs
    for path in dbs:
        if damage.startswith("garbage") and damage != "garbage-of-another-format":
            path.write_bytes(os.urandom(300))
        else:
            path.unlink()
    if damage == "garbage-of-another-format":
        (tiny_copy.root / ".doit.db").write_bytes(os.urandom(300))  # what a gdbm file would be called
    if damage.endswith("build-wiped"):
        shutil.rmtree(tiny_copy.root / "build")

    result = tiny_copy.export(*BUILD_ARGS, timeout=REBUILD_TIMEOUT)
    assert_ok(result)
    assert "Traceback" not in result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    if damage == "deleted":
        assert not warnings
    else:
        assert len(warnings) == 1 and "doit's database .doit.db was unreadable" in warnings[0], result.stderr
    assert set(tiny_copy.statuses().values()) == {"restored" if damage.endswith("build-wiped") else "cached"}
    assert_same_outputs(tiny_copy, built_tiny)


# -- bad input: one line, non-zero exit, nothing cached -----------------------------------------


def _checkpoint(folder, damage):
    import _qwen35_moe_hf as qwen35_moe_hf

    qwen35_moe_hf.save(folder, fused=False)
    if damage == "no-config":
        (folder / "config.json").unlink()
    else:
        _truncate(folder / "model.safetensors")


@pytest.mark.parametrize("damage, expected", [
    pytest.param("missing", "qwen_moe option checkpoint={dir}: no such folder", id="missing"),
    pytest.param("no-config", "{dir}/config.json: missing; a Hugging Face checkpoint directory needs its config.json",
                 id="no-config"),
    pytest.param("truncated", "{dir}/model.safetensors: truncated safetensors file", id="truncated"),
])
def test_bad_checkpoint_is_one_line_and_caches_nothing(project, tmp_path, damage, expected):
    folder = tmp_path / "ckpt"
    if damage != "missing":
        _checkpoint(folder, damage)
    line = one_error_line(project.export("model=qwen_moe", "target=cpu", f"checkpoint={folder}"))
    assert expected.format(dir=folder) in line
    assert not project.cache.exists() or set(records(project).values()) <= {"probe"}


def test_target_cuda_without_a_gpu_stops_before_any_stage_in_one_line(project):
    from cudabuild.backend.cuda_env import gpu_present

    if gpu_present(os.environ):
        pytest.skip("this machine has a GPU")
    done = project.export("model=tiny_lm", "target=cuda")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "cudabuild: error: target=cuda: this machine shows no NVIDIA GPU (no /dev/nvidia*, or CUDA_VISIBLE_DEVICES "
        "hides them); build with target=cpu, or target=auto to pick what is here"]
    assert not (project.root / "build").exists() and not records(project)
    # `doit list` names the stages of a cuda build all the same: it builds nothing.
    listed = project.doit("list", "--all", "model=tiny_lm", "target=cuda")
    assert listed.returncode == 0 and "export:compile.decode" in listed.stdout


@pytest.mark.slow
def test_fallback_kernels_the_cuda_runtime_lacks_are_named_in_one_line(built_tiny):
    from doit.exceptions import TaskFailed
    from doit.task import Task

    from cudabuild.errors import CompileFailed, one_line
    from cudabuild.backend.fallbacks import check_cuda_fallbacks
    from cudabuild.engine.console.progress import CudabuildReporter

    # The fallbacks a real compile emitted (CPU shims, none of which the CUDA runtime provides).
    emitted = set(stamp(built_tiny, "compile.decode")["value"]["fallback_kernels"])
    assert emitted
    check_cuda_fallbacks("decode", {"aoti_torch_cuda_int4_plain_mm", "at::_ops::sort_stable::call"})  # provided
    with pytest.raises(CompileFailed) as failed:
        check_cuda_fallbacks("decode", emitted | {"aoti_torch_cuda_int4_plain_mm"})
    out = io.StringIO()
    CudabuildReporter(out, {}).add_failure(Task("export:compile.decode", None), TaskFailed(one_line(failed.value)))
    assert out.getvalue() == (
        f"cudabuild: error: [compile.decode] method decode needs {len(emitted)} fallback kernel(s) the ExecuTorch "
        f"CUDA runtime lacks: {', '.join(sorted(emitted))}; rewrite those ops or enable triton_kernel_mode\n"
    )

"""cudabuild.engine.action_cache: a damaged record (not JSON, no digest, an output outside build/)
is warned about, dropped and read as a miss, whichever way it is read, and a build then runs its
stage instead of failing; a record's write-back to the shared tier is tried again and, where it
cannot be, says why, where the result is stored."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from _faults import BUILD_ARGS, assert_same_outputs
from conftest import REPO, assert_ok
from test_remote_faults import proxy  # noqa: F401  (a faulty proxy in front of the session's S3 server)
from cudabuild.engine.tiers import base, factory
from cudabuild.engine.store import Store
from cudabuild.errors import CudabuildError


@pytest.fixture(autouse=True)
def local_only(monkeypatch):
    """A developer's own CUDABUILD_REMOTE must not reach these stores; tests that want one set it."""
    monkeypatch.delenv(base.REMOTE_ENV, raising=False)


_READ = """
import json, sys
from cudabuild.engine.store import Store
store = Store(sys.argv[1])
key, how = sys.argv[2], sys.argv[3]
read = {"lookup": lambda: store.actions.lookup(key, take=True)[0], "look": lambda: store.actions.lookup(key)[0],
        "local_record": lambda: store.actions.local_record(key),
        "records": lambda: dict(store.actions.records()).get(key)}[how]
print(json.dumps({"first": read(), "again": read(), "rows": sorted(e.key for e in store.table.entries("rec:"))}))
"""


def read_in_a_build(root, key: str, how: str) -> tuple[dict, list[str]]:
    """Read `key` twice the way `how` does, in a process of its own; (what it saw, its warning lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDABUILD_")}
    done = subprocess.run([sys.executable, "-c", _READ, str(root), key, how], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), [line for line in done.stderr.splitlines() if line.startswith("cudabuild: warning:")]


@pytest.mark.parametrize("how", ["lookup", "look", "local_record", "records"])
@pytest.mark.parametrize("damage", ["no-digest", "output-outside-build", "not-json"])
def test_damaged_local_record_is_warned_about_once_dropped_and_a_miss(tmp_path, how, damage):
    root = tmp_path / "cache"
    store = Store(root)
    try:
        sha = store.objects.put_bytes(b"program bytes")
        good = {"stage": "export.decode", "digest": "d" * 64, "outputs": {"program.json": sha}, "finals": []}
        store.actions.put_record("intact", good)
        key = "a1b2c3d4e5f6a7b8c9d0"
        if damage == "no-digest":
            store.actions.put_record(key, {k: v for k, v in good.items() if k != "digest"})
        elif damage == "output-outside-build":
            store.actions.put_record(key, dict(good, outputs={"../../escape": sha}))
        else:
            store.table.cache.set("rec:" + key, '{"stage": "export.decode", "outp')  # a torn or hand-edited row
    finally:
        store.close()

    seen, warnings = read_in_a_build(root, key, how)
    assert seen == {"first": None, "again": None, "rows": ["rec:intact"]}
    what = "in {root} is not a JSON object" if damage == "not-json" else "of export.decode in {root} is malformed"
    assert warnings == [f"cudabuild: warning: cached record {key[:12]} {what.format(root=root)}; dropped, its stage will run again"]

    store = Store(root)
    try:
        record, source = store.actions.lookup("intact", take=True)
        assert source == "local" and {k: record[k] for k in good} == good
        assert [k for k, _ in store.actions.records()] == ["intact"]
    finally:
        store.close()


@pytest.mark.slow
def test_build_runs_the_stage_whose_record_is_damaged_instead_of_failing(built_tiny, tiny_copy):
    # package's record without its digest: restoring it once raised KeyError in Runner._restore.
    key = tiny_copy.stamp("package")["key"]
    store = Store(tiny_copy.cache)
    try:
        record = store.actions.local_record(key)
        store.actions.put_record(key, {k: v for k, v in record.items() if k != "digest"})
    finally:
        store.close()
    shutil.rmtree(tiny_copy.root / "build")

    result = tiny_copy.export(*BUILD_ARGS)
    assert_ok(result)
    statuses = tiny_copy.statuses()
    assert statuses["package"] == "ran" and statuses["export.decode"] == "restored"
    assert f"cudabuild: warning: cached record {key[:12]} of package in {tiny_copy.cache} is malformed" in result.stderr
    assert_same_outputs(tiny_copy, built_tiny)


def _s3_store(root, url, monkeypatch) -> tuple[Store, list]:
    """A store whose shared tier is the S3 bucket at `url` (through the proxy's AWS_ENDPOINT_URL),
    its warnings collected."""
    monkeypatch.setenv(base.REMOTE_ENV, url)
    warnings = []
    return Store(root, remote=factory.from_env(warn=warnings.append)), warnings


def test_a_push_that_fails_is_tried_again_and_one_that_cannot_says_why(s3_env, proxy, tmp_path, monkeypatch):  # noqa: F811
    """Issue 59: a result's write-back to the shared tier that failed was dropped without a word.
    publish tries it again while the tier takes writes (a fault the SDK's own retries did not
    outlast), and says why it could not."""
    url = s3_env.url("publish")
    store, warnings = _s3_store(tmp_path / "cache", url, monkeypatch)
    try:
        blob = store.objects.put_bytes(os.urandom(1 << 20))
        record = {"stage": "export.decode", "digest": "d", "outputs": {"program.json": blob}}
        proxy.drop_next(3)  # every attempt of the first call: the first push fails
        assert store.actions.publish("k" * 64, record) is None
        assert proxy.faults_done["dropped"] == 3
        reader, _ = _s3_store(tmp_path / "reader", url, monkeypatch)
        try:
            assert reader.remote.get_record("k" * 64)["outputs"] == record["outputs"]
            assert reader.objects.fetch(blob, tmp_path / "out").read_bytes() == store.objects.read_bytes(blob)
        finally:
            reader.close()

        proxy.down = True  # every call fails, until the tier is given up
        other = store.objects.put_bytes(os.urandom(1 << 20))
        why = store.actions.publish("j" * 64, dict(record, outputs={"program.json": other}))
        # Tried again until the tier was given up (its calls count the failures: FAILURES_TO_GIVE_UP).
        assert re.fullmatch(rf"the upload of blob {other[:12]} failed; tried [23] times", why), why
        assert not store.remote.writable and "continuing with the local cache only" in warnings[-1], warnings
        assert store.actions.publish("i" * 64, record) == ("it takes no writes from this process (read-only, or given up or "
                                                   "refused a write earlier: see its warning)")
    finally:
        store.close()


def test_a_result_the_shared_tier_did_not_take_is_said_where_it_is_stored(s3_env, proxy, project, tmp_path, monkeypatch,
                                                                          capfd):  # noqa: F811
    """A result stored and not taken by the shared tier is said at once (ActionCache.write_back),
    instead of the driver's later "not in the shared tier": on a cluster's worker, whose driver
    restores from the tier and which requires the write-back, the stage fails; elsewhere, a push
    whose every try failed gave the tier up, and the tier's own one line says it there."""
    from cudabuild.config import load_config
    from cudabuild.engine.console import terminal
    from cudabuild.engine.context import StageResult
    from cudabuild.engine.graph import Stage
    from cudabuild.engine.runner import Runner

    # The terminal's stderr is a copy of fd 2 made at its first use: made again, under capfd.
    monkeypatch.setattr(terminal, "_STREAMS", {})
    store, tier_said = _s3_store(tmp_path / "cache", s3_env.url("store-result"), monkeypatch)
    try:
        config = load_config(project.root, {"model": "tiny_lm", "target": "cpu"}, store)
        proxy.down = True
        for required in (False, True):
            (tmp_path / "program.json").write_text("{}")  # the store takes it in
            runner = Runner(config, store, run_id="test")
            stage, key = Stage("export", "decode"), ("r" if required else "w") * 64
            result = StageResult({"program.json": tmp_path / "program.json"})
            if not required:
                runner.store_result(stage, key, {}, result, started=0.0, why=None, peak_rss=None)
                # Every try failed, so the tier was given up in the push: its own one line says so
                # there and then, and the stage adds none (one fault, one line: see test_remote's
                # Redis stopped mid-build).
                said = [line for line in capfd.readouterr().err.splitlines() if "export.decode" in line]
                assert store.remote.down and said == []
                assert len(tier_said) == 1 and "continuing with the local cache only" in tier_said[0], tier_said
            else:
                # What a cluster's worker stores (cudabuild.engine.far_end.run, its write-back required).
                record = store.actions.store(key, stage.id, result, False, config.build_dir, 0.0, runner.io(stage).handed_on)
                with pytest.raises(CudabuildError, match=rf"^stage export.decode: its result {key[:12]} was not written "
                                                         r"to the shared tier .* so the driver cannot restore it; fix the "
                                                         r"tier \(its warning says what failed\) and build again$"):
                    store.actions.write_back(stage.id, key, record, required=True)
            assert store.actions.local_record(key) is not None  # this cache keeps it either way
    finally:
        store.close()

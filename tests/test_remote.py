"""The Redis tier (cudabuild.engine.tiers: redis.py, base.py, factory.py) and the shared tier end
to end, against a real redis-server on loopback.

Each test gets its own server (a free 127.0.0.1 port, no persistence, in a tmp dir, killed at
teardown). The end-to-end tests seed Redis from the session's one real tiny_lm build (its local
cache pushed with base.push_store) and build in fresh projects with empty caches, so no test
here runs a whole cold build of its own; the two that compile, compile one method.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from _leases import RENEWALS_REPORTED, assert_taken_over_when_the_holder_dies, held_past_its_time, holder_process

from conftest import Project, assert_ok, new_project
from cudabuild.engine.tiers import base, factory
from cudabuild.engine.tiers.base import push_store
from cudabuild.engine.tiers.redis import RedisTier
from cudabuild.engine.store import Store

REDIS_SERVER = shutil.which("redis-server")
BUILD = ("model=tiny_lm", "target=cpu")
STAGES = ["probe", "trace.decode", "trace.prefill", "export.decode", "export.prefill", "edge.decode", "edge.prefill",
          "compile.decode", "compile.prefill", "blob.decode", "blob.prefill", "package", "verify.decode", "verify.prefill"]


@dataclass
class Server:
    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed; the remote tier is only tested against a real one")
    port = _free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    srv = Server(port, process)
    for _ in range(200):  # up to 10 s
        try:
            if srv.client().ping():
                break
        except Exception:
            time.sleep(0.05)
    else:
        srv.stop()
        pytest.fail(f"redis-server did not answer on 127.0.0.1:{port}")
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def no_ambient_remote(monkeypatch):
    """A developer's own CUDABUILD_REMOTE must not reach these tests' stores."""
    for name in (base.REMOTE_ENV, base.KEY_ENV, base.MODE_ENV, base.LEASE_ENV, base.WAIT_ENV):
        monkeypatch.delenv(name, raising=False)


def make_tier(server: Server, warnings: list, **kw) -> RedisTier:
    return RedisTier(server.url, warn=warnings.append, **kw)


def seed(project: Project, server: Server, secret: bytes | None = None) -> int:
    store = Store(project.cache)
    try:
        return push_store(store, RedisTier(server.url, secret=secret))
    finally:
        store.close()


def warning_lines(output, *words: str) -> list[str]:
    """cudabuild's own warning lines (not Python's FutureWarnings from torch) holding every word."""
    text = output if isinstance(output, str) else output.stdout + output.stderr
    return [line for line in text.splitlines()
            if line.startswith(("cudabuild: warning:", "warning:")) and all(w in line for w in words)]


def sha_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stamp_key(project: Project, stage: str) -> str:
    return json.loads((project.root / "build/tiny_lm/cpu/.stamps" / f"{stage}.json").read_text())["key"]


def forget_locally(project: Project, stage: str) -> str:
    """Make a built copy need `stage` again: drop its stamp and its local record. Returns its key."""
    key = stamp_key(project, stage)
    (project.root / "build/tiny_lm/cpu/.stamps" / f"{stage}.json").unlink()
    store = Store(project.cache)
    store.actions.drop_record(key)
    store.close()
    return key


# -- unit level: chunks, records, leases, degrading ------------------------------------------------------


def test_blob_round_trip_in_chunks(server, tmp_path):
    warnings = []
    tier = make_tier(server, warnings, chunk_bytes=1000)
    data = os.urandom(10_500)
    sha = hashlib.sha256(data).hexdigest()
    assert tier.put_blob(sha, io.BytesIO(data))
    r = server.client()
    assert sorted(k.decode() for k in r.keys(f"cudabuild:chunk:{sha}:*")) == sorted(f"cudabuild:chunk:{sha}:{i}" for i in range(11))
    assert json.loads(r.get(f"cudabuild:blob:{sha}")) == {"size": 10_500, "chunks": 11, "chunk_bytes": 1000}
    fresh = make_tier(server, warnings)
    assert fresh.get_blob_to_file(sha, tmp_path / "out") and (tmp_path / "out").read_bytes() == data
    assert fresh.stats["bytes_in"] == 10_500 and not warnings


def test_upload_cut_short_publishes_no_blob(server, tmp_path):
    """Chunks first, manifest last: a writer that dies mid-blob leaves nothing a reader would take."""
    import redis

    class DiesMidway(io.BytesIO):
        def read(self, n=-1):
            if self.tell() >= 9000:
                raise redis.exceptions.ConnectionError("connection lost mid-upload")
            return super().read(n)

    warnings = []
    data = os.urandom(20_000)
    sha = hashlib.sha256(data).hexdigest()
    writer = make_tier(server, warnings, chunk_bytes=1000)
    assert not writer.put_blob(sha, DiesMidway(data))
    r = server.client()
    assert r.exists(f"cudabuild:chunk:{sha}:0") and not r.exists(f"cudabuild:blob:{sha}")
    reader = make_tier(server, [])
    assert not reader.has_blobs([sha]) and not reader.get_blob_to_file(sha, tmp_path / "out")
    # One failed call is a miss, not an outage: the tier stays, and says the failure once its
    # outcome is known (here: the next call that gets an answer).
    assert not warnings and writer.writable and writer.get_record("nothing") is None
    assert len(warnings) == 1 and "upload of blob" in warnings[0] and "dropped" in warnings[0], warnings


def test_corrupt_or_evicted_chunk_is_never_served(server, tmp_path):
    warnings = []
    writer = make_tier(server, [], chunk_bytes=1000)
    r = server.client()
    blobs = [os.urandom(5000) for _ in range(2)]
    corrupt, evicted = (hashlib.sha256(b).hexdigest() for b in blobs)
    for data in blobs:
        assert writer.put_blob(hashlib.sha256(data).hexdigest(), io.BytesIO(data))
    r.setrange(f"cudabuild:chunk:{corrupt}:2", 10, b"flipped")
    r.delete(f"cudabuild:chunk:{evicted}:4")
    reader = make_tier(server, warnings)
    assert not reader.get_blob_to_file(corrupt, tmp_path / "a") and not reader.get_blob_to_file(evicted, tmp_path / "b")
    # A corrupt blob is reported and deleted; an evicted chunk is an ordinary miss. Neither is offered again.
    assert len(warnings) == 1 and corrupt[:12] in warnings[0] and "sha256" in warnings[0]
    assert not r.exists(f"cudabuild:blob:{corrupt}") and not r.exists(f"cudabuild:blob:{evicted}")
    assert not reader.has_blobs([corrupt]) and not reader.has_blobs([evicted])


RECORD = {"stage": "package", "digest": "d" * 64, "outputs": {"model.pte": "a" * 64}, "finals": ["model.pte"],
          "value": None, "seconds": 1.25}


def test_records_are_signed_and_checked(server):
    warnings = []
    assert make_tier(server, [], secret=b"fleet").put_record("k-signed", RECORD)
    assert make_tier(server, []).put_record("k-unsigned", RECORD)
    trusting = make_tier(server, warnings, secret=b"fleet")
    assert trusting.get_record("k-signed") == RECORD
    assert trusting.get_record("k-unsigned") is None
    assert make_tier(server, warnings, secret=b"other").get_record("k-signed") is None
    # A record copied under another key does not verify either: the key is signed with it.
    r = server.client()
    r.set("cudabuild:rec:k-moved", r.get("cudabuild:rec:k-signed"))
    assert trusting.get_record("k-moved") is None
    assert len(warnings) == 2  # once per build (per tier) is enough
    assert "k-unsigned" in warnings[0] and "is unsigned; ignored" in warnings[0]
    assert "k-signed" in warnings[1] and "is badly signed; ignored" in warnings[1]
    assert make_tier(server, []).get_record("k-signed") == RECORD  # no key: signatures are not checked


def test_record_naming_paths_outside_build_is_ignored(server):
    warnings = []
    tier = make_tier(server, warnings)
    bad = dict(RECORD, outputs={"../../escape": "a" * 64}, finals=["../../escape"])
    tier.put_record("k", bad)
    assert tier.get_record("k") is None and "malformed" in warnings[0]


def test_lease_is_held_by_heartbeat_and_lapses_when_the_holder_dies(server):
    with holder_process(f"""
        import time
        from cudabuild.engine.tiers.redis import RedisTier
        tier = RedisTier("{server.url}", lease_seconds=1.0)
        {RENEWALS_REPORTED}
        lease = tier.try_lease("K")
        with lease:
            print("held", flush=True)
            time.sleep(600)
    """, "held") as holder:
        tier = make_tier(server, [], lease_seconds=1.0)
        held_past_its_time(holder, lease_seconds=1.0)  # only the heartbeat keeps it
        assert tier.try_lease("K") is None
        assert_taken_over_when_the_holder_dies(tier, holder)


def test_read_only_tier_never_writes(server):
    r = server.client()
    writer = make_tier(server, [])
    writer.put_record("k", RECORD)
    before = sorted(r.keys("*"))
    reader = make_tier(server, [], read_only=True)
    data = b"x" * 100
    assert not reader.put_blob(hashlib.sha256(data).hexdigest(), io.BytesIO(data))
    assert not reader.put_record("k2", RECORD)
    assert isinstance(reader.try_lease("K"), base.NoLease)  # nobody holds it: build, without a lease
    assert reader.get_record("k") == RECORD
    assert sorted(r.keys("*")) == before


def test_unreachable_redis_costs_one_warning_and_little_time():
    warnings = []
    tier = RedisTier(f"redis://127.0.0.1:{_free_port()}/0", warn=warnings.append)
    for i in range(50):
        assert tier.get_record(f"k{i}") is None and not tier.has_blobs(["a" * 64])
        assert not tier.put_record(f"k{i}", RECORD)
        assert isinstance(tier.try_lease(f"k{i}"), base.NoLease)
    # Given up after a few calls, not tried again by each of the 150 (what "little time" comes from).
    assert sum(tier.faults.values()) <= base.FAILURES_TO_GIVE_UP, tier.faults
    assert len(warnings) == 1 and "continuing with the local cache only" in warnings[0]


def test_settings_are_checked_together():
    from cudabuild.errors import InvalidRemote

    with pytest.raises(InvalidRemote, match=r"not a Redis URL.*; CUDABUILD_REMOTE_MODE=sometimes: expected read-write or read-only"):
        factory.from_env({"CUDABUILD_REMOTE": "http://cache:80", "CUDABUILD_REMOTE_MODE": "sometimes"})
    tier = factory.from_env({"CUDABUILD_REMOTE": "redis://:pw@127.0.0.1:1/2", "CUDABUILD_REMOTE_MODE": "read-only"})
    assert tier.read_only and not tier.writable and tier.where == "redis://:***@127.0.0.1:1/2"
    assert factory.from_env({}) is None


def test_compile_environment_shares_inductor_autotuning(monkeypatch, tmp_path):
    from cudabuild.backend.stages.compile import compile_environment
    from cudabuild.backend.toolchain import ENV_IGNORED

    monkeypatch.setenv("CUDABUILD_REMOTE", "redis://127.0.0.1:6390/3")
    env = compile_environment("cpu", {}, tmp_path)
    assert env["TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"] == "1" and env["TORCHINDUCTOR_REDIS_URL"] == "redis://127.0.0.1:6390/3"
    assert (env["TORCHINDUCTOR_REDIS_HOST"], env["TORCHINDUCTOR_REDIS_PORT"]) == ("127.0.0.1", "6390")
    assert {k for k in env if "REDIS" in k or "REMOTE" in k} <= ENV_IGNORED  # never part of a key
    # inductor reads these names (torch/_inductor/config.py, remote_cache.py in the installed torch).
    import torch._inductor.config as config
    import torch._inductor.remote_cache as remote_cache

    assert "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE" in Path(config.__file__).read_text()
    assert all(name in Path(remote_cache.__file__).read_text() for name in
               ("TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT"))
    monkeypatch.setenv("CUDABUILD_REMOTE_MODE", "read-only")  # inductor cannot be made read-only
    assert "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE" not in compile_environment("cpu", {}, tmp_path)


# -- end to end: real builds in fresh projects served from a Redis seeded by the session's build -----------


def test_no_op_with_remote_set_touches_no_network_and_no_redis(built_tiny, tmp_path):
    proj = built_tiny.copy(tmp_path)
    dead = f"redis://127.0.0.1:{_free_port()}/0"  # any call to it would print a warning
    result = proj.doit("export", *BUILD, env=proj.env(CUDABUILD_REMOTE=dead, PYTHONPROFILEIMPORTTIME="1"))
    assert_ok(result)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "cudabuild.engine.tiers.factory" in imported and "redis" not in imported and "torch" not in imported
    assert set(proj.statuses().values()) == {"cached"} and not warning_lines(result)


@pytest.mark.slow
def test_second_machine_builds_from_redis_with_zero_compiles(built_tiny, server, tmp_path):
    assert seed(built_tiny, server) == len(STAGES)
    fresh = new_project(tmp_path)
    result = fresh.export(*BUILD, env=fresh.env(CUDABUILD_REMOTE=server.url))
    assert_ok(result)
    assert fresh.statuses() == {s: "remote" for s in STAGES}
    out = fresh.root / "build/tiny_lm/cpu"
    assert built_tiny.manifest()["outputs"] == fresh.manifest()["outputs"]
    for name, digest in fresh.manifest()["outputs"].items():
        assert sha_file(out / name) == digest == sha_file(built_tiny.root / "build/tiny_lm/cpu" / name)
    assert f"from remote {len(STAGES)}" in result.stdout and not warning_lines(result)


@pytest.mark.slow
def test_a_fresh_machine_restores_from_the_tier_without_importing_torch(built_tiny, server, tmp_path):
    # The tier also keeps what the recipe declares (keyed by its sources), so an empty cache needs
    # neither the recipe's import nor torch's to know the build: every stage comes from the tier.
    seed(built_tiny, server)
    fresh = new_project(tmp_path)
    probe = (
        "import sys; sys.argv = ['doit', 'export', 'model=tiny_lm', 'target=cpu'];\n"
        "from doit.doit_cmd import DoitMain; from doit.cmd_base import ModuleTaskLoader;\n"
        "import dodo; rc = DoitMain(ModuleTaskLoader(dodo)).run(sys.argv[1:]);\n"
        "print('IMPORTED', 'torch' in sys.modules, 'executorch' in sys.modules, rc)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=fresh.root, env=fresh.env(CUDABUILD_REMOTE=server.url),
                            capture_output=True, text=True, timeout=600)
    assert_ok(result)
    assert "IMPORTED False False 0" in result.stdout
    assert fresh.statuses() == {s: "remote" for s in STAGES} and not warning_lines(result)
    assert fresh.manifest()["outputs"] == built_tiny.manifest()["outputs"]


def test_explain_forecasts_what_redis_would_serve_and_changes_nothing(built_tiny, server, tmp_path):
    seed(built_tiny, server)
    fresh = new_project(tmp_path)
    redis_keys = sorted(server.client().keys("*"))
    result = subprocess.run([sys.executable, "-m", "cudabuild", "explain", *BUILD], cwd=fresh.root, capture_output=True,
                            text=True, timeout=600, env=fresh.env(CUDABUILD_REMOTE=server.url))
    assert result.returncode == 0, result.stdout + result.stderr
    said = dict(line.strip().split(None, 1) for line in result.stdout.splitlines()[1:])
    assert list(said) == STAGES
    assert all(v.startswith(f"restorable from the shared cache {server.url}") for v in said.values()), said
    # Looking copied nothing: no record reached the fresh local cache, no key was added to Redis.
    store = Store(fresh.cache)
    try:
        assert list(store.actions.records()) == [] and store.table.usage().get("blob", (0, 0))[0] == 0
    finally:
        store.close()
    assert sorted(server.client().keys("*")) == redis_keys
    assert not (fresh.root / "build").exists()


@pytest.mark.slow
def test_corrupt_remote_blob_is_rejected_and_rebuilt(built_tiny, server, tmp_path):
    seed(built_tiny, server)
    pte = built_tiny.manifest()["outputs"]["model.pte"]
    r = server.client()
    r.setrange(f"cudabuild:chunk:{pte}:0", 100, b"\x00corrupted\x00")
    fresh = new_project(tmp_path)
    result = fresh.export(*BUILD, env=fresh.env(CUDABUILD_REMOTE=server.url))
    assert_ok(result)
    statuses = fresh.statuses()
    assert statuses["package"] == "ran" and statuses["compile.decode"] == statuses["compile.prefill"] == "remote"
    assert len(warning_lines(result, pte[:12], "sha256")) == 1
    built = fresh.root / "build/tiny_lm/cpu/model.pte"
    assert sha_file(built) == fresh.manifest()["outputs"]["model.pte"] == pte  # rebuilt bit-identical
    # ...and written back whole: the next machine gets a good copy.
    assert make_tier(server, []).get_blob_to_file(pte, tmp_path / "again") and sha_file(tmp_path / "again") == pte


@pytest.mark.slow
def test_badly_signed_record_is_ignored(built_tiny, server, tmp_path):
    seed(built_tiny, server, secret=b"fleet")
    key = stamp_key(built_tiny, "probe")
    r = server.client()
    envelope = json.loads(r.get(f"cudabuild:rec:{key}"))
    envelope["record"]["value"]["compiler"] = "a compiler of the attacker's choosing"
    r.set(f"cudabuild:rec:{key}", json.dumps(envelope))
    fresh = new_project(tmp_path)
    result = fresh.export(*BUILD, env=fresh.env(CUDABUILD_REMOTE=server.url, CUDABUILD_REMOTE_KEY="fleet"))
    assert_ok(result)
    statuses = fresh.statuses()
    assert statuses["probe"] == "ran" and all(statuses[s] == "remote" for s in STAGES[1:])
    assert len(warning_lines(result, "badly signed")) == 1


@pytest.mark.slow
def test_read_only_builder_writes_nothing(built_tiny, server, tmp_path):
    seed(built_tiny, server)
    r = server.client()
    r.delete(f"cudabuild:rec:{stamp_key(built_tiny, 'probe')}")  # so this builder has something to build
    keys, size = sorted(r.keys("*")), r.dbsize()
    fresh = new_project(tmp_path)
    result = fresh.export(*BUILD, env=fresh.env(CUDABUILD_REMOTE=server.url, CUDABUILD_REMOTE_MODE="read-only"))
    assert_ok(result)
    statuses = fresh.statuses()
    assert statuses["probe"] == "ran" and statuses["compile.decode"] == "remote"
    assert r.dbsize() == size and sorted(r.keys("*")) == keys


@pytest.mark.slow
def test_two_builders_racing_for_one_key_compile_it_once(built_tiny, server, tmp_path):
    builders = [built_tiny.copy(tmp_path / name) for name in ("a", "b")]
    for proj in builders:
        forget_locally(proj, "compile.decode")
    env = {"CUDABUILD_REMOTE": server.url, "CUDABUILD_REMOTE_LEASE_SECONDS": "3"}
    procs = [subprocess.Popen([sys.executable, "-m", "doit", "export", *BUILD], cwd=p.root, env=p.env(**env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in builders]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    decode = sorted(p.statuses()["compile.decode"] for p in builders)
    assert decode == ["ran", "remote"], outputs
    waiter = outputs[[p.statuses()["compile.decode"] for p in builders].index("remote")]
    assert "another builder is building" in waiter
    assert builders[0].manifest()["outputs"] == builders[1].manifest()["outputs"]
    assert not server.client().keys("cudabuild:lease:*")


@pytest.mark.slow
def test_redis_stopped_mid_build_leaves_a_correct_build_and_one_warning(built_tiny, server, tmp_path):
    proj = built_tiny.copy(tmp_path)
    forget_locally(proj, "compile.decode")
    env = proj.env(CUDABUILD_REMOTE=server.url, CUDABUILD_REMOTE_LEASE_SECONDS="1.5")
    proc = subprocess.Popen([sys.executable, "-m", "doit", "export", *BUILD], cwd=proj.root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # ends with the process
        lines.append(line)
        if line.startswith("> compile decode"):
            # Stopped once the compile's lease is taken (its heartbeat running), not after a time.
            deadline = time.monotonic() + 600
            while not server.client().keys("cudabuild:lease:*") and time.monotonic() < deadline:
                time.sleep(0.05)
            server.stop()
    proc.wait(timeout=600)
    output = "".join(lines)
    assert proc.returncode == 0, output
    assert proj.statuses()["compile.decode"] == "ran"
    manifest = proj.manifest()
    for name, digest in manifest["outputs"].items():
        assert sha_file(proj.root / "build/tiny_lm/cpu" / name) == digest
    assert all(v["passed"] for v in manifest["verify"].values())
    warned = warning_lines(output)
    assert len(warned) == 1 and "unreachable" in warned[0] and "continuing with the local cache only" in warned[0]

"""Blobs in an S3-compatible object store (cudabuild.engine.tiers.s3: client, blobs, tier, gc),
against a real one.

The server is SeaweedFS's `weed server -s3` on loopback, one per session (tests/_s3_server.py);
each test works under a fresh prefix of the bucket `cudabuild-cache`. The end-to-end tests seed the
tiers from the session's one real tiny_lm build (base.push_store) and build in fresh projects with
empty caches, like tests/test_remote.py does for Redis; none runs a whole cold build.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from _leases import RENEWALS_REPORTED, assert_taken_over_when_the_holder_dies, held_past_its_time, holder_process

from _s3_server import BUCKET, free_port
from conftest import REPO
from cudabuild.engine.tiers import base, factory
from cudabuild.engine.tiers.redis import RedisTier
from cudabuild.engine.tiers.s3.blobs import S3Blobs
from cudabuild.engine.tiers.s3.client import Bucket
from cudabuild.engine.tiers.s3.tier import S3Tier


@pytest.fixture(autouse=True)
def no_ambient_remote(monkeypatch):
    """A developer's own CUDABUILD_REMOTE or AWS settings must not reach these tests' stores."""
    for name in (base.REMOTE_ENV, base.BLOBS_ENV, base.KEY_ENV, base.MODE_ENV, base.LEASE_ENV,
                 base.WAIT_ENV):
        monkeypatch.delenv(name, raising=False)


def blobs_at(url: str, warnings: list, read_only: bool = False) -> S3Blobs:
    return S3Blobs(Bucket(url, read_only=read_only, warn=warnings.append))


def sha_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- blobs: streamed round trip, verified both ways ------------------------------------------------------


def test_blob_round_trip_is_streamed_in_parts(s3_env, tmp_path):
    url, warnings = s3_env.url("round-trip"), []
    data = os.urandom(20 << 20)  # 20 MiB: three 8 MiB parts
    sha = sha_of(data)
    (tmp_path / "blob").write_bytes(data)
    writer = blobs_at(url, warnings)
    with open(tmp_path / "blob", "rb") as source:
        assert writer.put_blob(sha, source)
    keys = s3_env.keys(url)
    assert keys[f"blobs/{sha}"] == len(data) and keys[f"used/{sha}"] == 0
    head = s3_env.client().head_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/blobs/{sha}")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of three parts
    reader = blobs_at(url, warnings)
    assert reader.has_blobs([sha]) and reader.get_blob_to_file(sha, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    assert (writer.stats["bytes_out"], reader.stats["bytes_in"]) == (len(data), len(data)) and not warnings
    assert writer.put_blob(sha, io.BytesIO(data)) and writer.stats["blobs_out"] == 1  # already there: not sent again


@pytest.mark.parametrize("size", [1000, 17 << 20])  # one PUT, and a multipart upload
def test_source_that_does_not_hash_to_its_name_is_never_published(s3_env, size):
    url, warnings = s3_env.url("changed"), []
    data = os.urandom(size)
    claimed = sha_of(data + b"x")
    assert not blobs_at(url, warnings).put_blob(claimed, io.BytesIO(data))
    assert not any(k.startswith("blobs/") for k in s3_env.keys(url))
    assert len(warnings) == 1 and "changed while it was uploaded" in warnings[0]
    uploads = s3_env.client().list_multipart_uploads(Bucket=BUCKET, Prefix=url.split("/", 3)[3]).get("Uploads", [])
    assert uploads == []  # aborted, not left behind


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_object_is_rejected_deleted_and_not_offered_again(s3_env, tmp_path, damage):
    url, warnings = s3_env.url(damage), []
    data = os.urandom(3 << 20)
    sha = sha_of(data)
    assert blobs_at(url, []).put_blob(sha, io.BytesIO(data))
    key = f"{url.split('/', 3)[3]}/blobs/{sha}"
    bad = data[:1000] + b"\x00flipped\x00" + data[1009:] if damage == "corrupt" else data[: len(data) // 2]
    s3_env.client().put_object(Bucket=BUCKET, Key=key, Body=bad)
    reader = blobs_at(url, warnings)
    assert reader.has_blobs([sha]) and not reader.get_blob_to_file(sha, tmp_path / "out")
    assert len(warnings) == 1 and sha[:12] in warnings[0] and "sha256" in warnings[0] and "deleted" in warnings[0]
    assert f"blobs/{sha}" not in s3_env.keys(url)
    assert not reader.has_blobs([sha]) and not reader.get_blob_to_file(sha, tmp_path / "again")


def test_read_only_blobs_never_write(s3_env, tmp_path):
    url = s3_env.url("read-only")
    data = os.urandom(5000)
    sha = sha_of(data)
    assert blobs_at(url, []).put_blob(sha, io.BytesIO(data))
    s3_env.client().put_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/blobs/{'b' * 64}", Body=b"not b's bytes")
    before = s3_env.keys(url)
    reader, warnings = blobs_at(url, [], read_only=True), []
    reader.bucket.warn = warnings.append
    other = os.urandom(100)
    assert not reader.put_blob(sha_of(other), io.BytesIO(other))
    assert reader.get_blob_to_file(sha, tmp_path / "out") and (tmp_path / "out").read_bytes() == data
    assert not reader.get_blob_to_file("b" * 64, tmp_path / "bad")  # corrupt: ignored, not deleted
    assert "ignored in" in warnings[0]
    assert s3_env.keys(url) == before  # no blob, no use marker, no delete


def test_unreachable_store_costs_one_warning_and_little_time(s3_env, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    warnings = []
    blobs = blobs_at(f"s3://{BUCKET}/nowhere", warnings)
    for i in range(20):
        data = f"blob {i}".encode()
        assert not blobs.has_blobs([sha_of(data)]) and not blobs.put_blob(sha_of(data), io.BytesIO(data))
        assert not blobs.get_blob_to_file(sha_of(data), tmp_path / "out")
    # Given up after a few calls, not tried again by each of the 60 (what "little time" comes from).
    assert sum(blobs.bucket.faults.values()) <= base.FAILURES_TO_GIVE_UP, blobs.bucket.faults
    assert len(warnings) == 1 and "unreachable" in warnings[0] and "continuing with the local cache only" in warnings[0]


def test_settings_are_checked_together():
    from cudabuild.errors import InvalidRemote

    with pytest.raises(InvalidRemote, match=r"CUDABUILD_REMOTE_BLOBS=redis://x:1/0 is not an s3:// URL.*"
                                            r"CUDABUILD_REMOTE_MODE=never"):
        factory.from_env({"CUDABUILD_REMOTE": "redis://127.0.0.1:1/0", "CUDABUILD_REMOTE_BLOBS": "redis://x:1/0",
                         "CUDABUILD_REMOTE_MODE": "never"})
    with pytest.raises(InvalidRemote, match=r"CUDABUILD_REMOTE=s3:///p is not an S3 URL"):
        factory.from_env({"CUDABUILD_REMOTE": "s3:///p"})
    hybrid = factory.from_env({"CUDABUILD_REMOTE": "redis://127.0.0.1:1/0", "CUDABUILD_REMOTE_BLOBS": "s3://b/p/"})
    assert isinstance(hybrid, RedisTier) and hybrid.where == "redis://127.0.0.1:1/0 (blobs in s3://b/p)"
    with pytest.raises(InvalidRemote, match=r"CUDABUILD_REMOTE_BLOBS=s3://b/p is set without CUDABUILD_REMOTE"):
        factory.from_env({"CUDABUILD_REMOTE_BLOBS": "s3://b/p"})  # blobs alone: no tier to hold records


def test_blobs_without_a_tier_stop_the_build_with_one_line(project):
    done = project.export(env=project.env(CUDABUILD_REMOTE_BLOBS="s3://cudabuild-cache/x"))
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDABUILD_REMOTE_BLOBS=s3://cudabuild-cache/x is set without CUDABUILD_REMOTE" in lines[0]
    assert not (project.root / "build").exists()


# -- object-store-only mode: records and leases as objects ----------------------------------------------

RECORD = {"stage": "package", "digest": "d" * 64, "outputs": {"model.pte": "a" * 64}, "finals": ["model.pte"],
          "value": None, "seconds": 1.25}


def s3_tier(url: str, warnings: list, **kw) -> S3Tier:
    return factory.from_env({"CUDABUILD_REMOTE": url, **{k: str(v) for k, v in kw.items()}}, warn=warnings.append)


def test_records_are_signed_and_checked_in_the_object_store(s3_env):
    url, warnings = s3_env.url("records"), []
    assert s3_tier(url, [], CUDABUILD_REMOTE_KEY="fleet").put_record("k-signed", RECORD)
    assert s3_tier(url, []).put_record("k-unsigned", RECORD)
    trusting = s3_tier(url, warnings, CUDABUILD_REMOTE_KEY="fleet")
    assert trusting.get_record("k-signed") == RECORD and trusting.get_record("k-unsigned") is None
    prefix = url.split("/", 3)[3]
    body = s3_env.client().get_object(Bucket=BUCKET, Key=f"{prefix}/rec/k-signed")["Body"].read()
    envelope = json.loads(body)
    envelope["record"]["outputs"]["model.pte"] = "b" * 64
    s3_env.client().put_object(Bucket=BUCKET, Key=f"{prefix}/rec/k-tampered", Body=json.dumps(envelope).encode())
    assert s3_tier(url, warnings, CUDABUILD_REMOTE_KEY="fleet").get_record("k-tampered") is None
    assert [("unsigned" in w, "badly signed" in w) for w in warnings] == [(True, False), (False, True)]
    assert s3_tier(url, []).get_record("missing") is None


def test_object_store_lease_is_held_by_heartbeat_and_lapses_when_the_holder_dies(s3_env):
    url = s3_env.url("lease")
    with holder_process(f"""
        import time
        from cudabuild.engine.tiers import factory
        tier = factory.from_env({{"CUDABUILD_REMOTE": "{url}", "CUDABUILD_REMOTE_LEASE_SECONDS": "2"}})
        {RENEWALS_REPORTED}
        lease = tier.try_lease("K")
        with lease:
            print(type(lease).__name__, flush=True)
            time.sleep(600)
    """, "Lease", env={**os.environ, **s3_env.env()}) as holder:
        tier = s3_tier(url, [], CUDABUILD_REMOTE_LEASE_SECONDS=2)
        held_past_its_time(holder, lease_seconds=2.0)  # only the heartbeat keeps it
        assert tier.try_lease("K") is None
        assert tier.conditional_writes is True and not any(".probe" in k for k in s3_env.keys(url))
        assert_taken_over_when_the_holder_dies(tier, holder, released=lambda: "lease/K" not in s3_env.keys(url))


def test_only_one_of_many_racing_builders_takes_a_lease(s3_env):
    url = s3_env.url("race")
    racer = textwrap.dedent(f"""
        import sys, time
        from cudabuild.engine.tiers import factory
        tier = factory.from_env({{"CUDABUILD_REMOTE": "{url}"}})
        tier._conditional_writes_work()
        while time.time() < float(sys.argv[1]):
            pass
        print(type(tier.try_lease("K")).__name__)
    """)
    start = time.time() + 3
    procs = [subprocess.Popen([sys.executable, "-c", racer, str(start)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **s3_env.env()}) for _ in range(4)]
    got = sorted(p.communicate(timeout=600)[0].strip() for p in procs)
    assert got == ["Lease"] + ["NoneType"] * 3, got


def test_read_only_object_store_tier_never_writes(s3_env):
    url = s3_env.url("ro-tier")
    s3_tier(url, []).put_record("k", RECORD)
    before = s3_env.keys(url)
    reader = s3_tier(url, [], CUDABUILD_REMOTE_MODE="read-only")
    data = b"x" * 100
    assert not reader.put_blob(sha_of(data), io.BytesIO(data)) and not reader.put_record("k2", RECORD)
    assert isinstance(reader.try_lease("K"), base.NoLease) and reader.get_record("k") == RECORD
    assert s3_env.keys(url) == before


# -- end to end: real builds in fresh projects, served from tiers seeded by the session's build -------------

from conftest import Project, assert_ok, new_project  # noqa: E402
from cudabuild.engine.store import Store  # noqa: E402
from test_remote import BUILD, STAGES, forget_locally, server, sha_file, stamp_key, warning_lines  # noqa: E402,F401


def seed(project: Project, tier) -> int:
    store = Store(project.cache)
    try:
        return base.push_store(store, tier)
    finally:
        store.close()


def build_env(project: Project, s3, **extra) -> dict:
    return project.env(**s3.env(), **extra)


def test_no_op_with_s3_tiers_set_makes_no_network_call_and_imports_no_boto3(built_tiny, tmp_path):
    proj = built_tiny.copy(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"  # any call to it would print a warning
    for tiers in ({"CUDABUILD_REMOTE": f"redis://127.0.0.1:{free_port()}/0", "CUDABUILD_REMOTE_BLOBS": f"s3://{BUCKET}/x"},
                  {"CUDABUILD_REMOTE": f"s3://{BUCKET}/x"}):
        result = proj.doit("export", *BUILD, env=proj.env(AWS_ENDPOINT_URL=dead, PYTHONPROFILEIMPORTTIME="1", **tiers))
        assert_ok(result)
        imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
        assert "cudabuild.engine.tiers.factory" in imported
        assert not imported & {"boto3", "botocore", "redis", "torch"}
        assert set(proj.statuses().values()) == {"cached"} and not warning_lines(result)


@pytest.mark.slow
def test_fresh_machine_builds_from_redis_records_and_s3_blobs(built_tiny, server, s3_server, tmp_path, monkeypatch):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    blobs = s3_server.url("hybrid")
    tiers = {"CUDABUILD_REMOTE": server.url, "CUDABUILD_REMOTE_BLOBS": blobs}
    assert seed(built_tiny, factory.from_env(tiers)) == len(STAGES)
    r = server.client()
    assert not r.keys("cudabuild:chunk:*") and not r.keys("cudabuild:blob:*")  # blobs went to S3, records to Redis
    assert len(r.keys("cudabuild:rec:*")) == len(STAGES) + 1  # and what the recipe declares (action_cache.SHARED_DOCS)
    stored = {k[len("blobs/"):] for k in s3_server.keys(blobs) if k.startswith("blobs/")}
    assert set(built_tiny.manifest()["outputs"].values()) <= stored

    looker = new_project(tmp_path / "explain")
    said = looker.explain(**build_env(looker, s3_server, **tiers))
    assert list(said) == STAGES
    where = f"{server.url} (blobs in {blobs})"
    assert all(v.startswith(f"restorable from the shared cache {where}") for v in said.values()), said

    fresh = new_project(tmp_path / "fresh")
    result = fresh.export(*BUILD, env=build_env(fresh, s3_server, **tiers))
    assert_ok(result)
    assert fresh.statuses() == {s: "remote" for s in STAGES}
    for name, digest in fresh.manifest()["outputs"].items():
        assert sha_file(fresh.root / "build/tiny_lm/cpu" / name) == digest
    assert fresh.manifest()["outputs"] == built_tiny.manifest()["outputs"]
    assert f"from remote {len(STAGES)}" in result.stdout and not warning_lines(result)
    stats = fresh.cudabuild("cache", "stats", **s3_server.env(), **tiers).stdout
    assert "restores" in stats and blobs in stats, stats


@pytest.mark.slow
def test_object_store_only_rejects_a_corrupt_blob_and_a_badly_signed_record(built_tiny, s3_env, tmp_path):
    url = s3_env.url("only")
    tiers = {"CUDABUILD_REMOTE": url, "CUDABUILD_REMOTE_KEY": "fleet"}
    seed(built_tiny, factory.from_env(tiers))
    prefix = url.split("/", 3)[3]
    client = s3_env.client()
    probe = f"{prefix}/rec/{stamp_key(built_tiny, 'probe')}"
    envelope = json.loads(client.get_object(Bucket=BUCKET, Key=probe)["Body"].read())
    envelope["record"]["value"]["compiler"] = "a compiler of the attacker's choosing"
    client.put_object(Bucket=BUCKET, Key=probe, Body=json.dumps(envelope).encode())
    pte = built_tiny.manifest()["outputs"]["model.pte"]
    good = client.get_object(Bucket=BUCKET, Key=f"{prefix}/blobs/{pte}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/blobs/{pte}", Body=good[: len(good) // 2])  # truncated

    fresh = new_project(tmp_path)
    result = fresh.export(*BUILD, env=build_env(fresh, s3_env, **tiers))
    assert_ok(result)
    statuses = fresh.statuses()
    assert statuses["probe"] == "ran" and statuses["package"] == "ran"
    assert all(statuses[s] == "remote" for s in STAGES if s not in ("probe", "package")), statuses
    assert len(warning_lines(result, "badly signed")) == 1 and len(warning_lines(result, pte[:12], "sha256")) == 1
    assert sha_file(fresh.root / "build/tiny_lm/cpu/model.pte") == pte  # rebuilt bit-identical...
    again = factory.from_env(tiers)
    assert again.get_blob_to_file(pte, tmp_path / "again") and sha_file(tmp_path / "again") == pte  # ...and re-published
    assert again.get_record(stamp_key(built_tiny, "probe")) is not None  # the probe's record, signed again
    assert not any(k.startswith("lease/") for k in s3_env.keys(url))


@pytest.mark.slow
def test_read_only_builder_writes_nothing_to_the_object_store(built_tiny, s3_env, tmp_path):
    url = s3_env.url("read-only-build")
    seed(built_tiny, factory.from_env({"CUDABUILD_REMOTE": url}))
    s3_env.client().delete_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/rec/{stamp_key(built_tiny, 'probe')}")
    before = s3_env.keys(url)
    fresh = new_project(tmp_path)
    result = fresh.export(*BUILD, env=build_env(fresh, s3_env, CUDABUILD_REMOTE=url, CUDABUILD_REMOTE_MODE="read-only"))
    assert_ok(result)
    statuses = fresh.statuses()
    assert statuses["probe"] == "ran" and statuses["compile.decode"] == "remote"
    assert s3_env.keys(url) == before and not warning_lines(result)


@pytest.mark.slow
def test_unreachable_object_store_means_one_warning_and_a_local_build(built_tiny, tmp_path):
    proj = built_tiny.copy(tmp_path)
    forget_locally(proj, "probe")  # the cheapest stage to run again; it has to be looked up remotely first
    env = proj.env(CUDABUILD_REMOTE=f"s3://{BUCKET}/down", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
                   AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1")
    result = proj.export(*BUILD, env=env)
    assert_ok(result)
    statuses = proj.statuses()
    assert statuses["probe"] == "ran" and set(statuses.values()) == {"ran", "cached"}
    for name, digest in proj.manifest()["outputs"].items():
        assert sha_file(proj.root / "build/tiny_lm/cpu" / name) == digest
    warned = warning_lines(result)
    assert len(warned) == 1 and "unreachable" in warned[0] and "continuing with the local cache only" in warned[0]


# -- cache gc --remote --------------------------------------------------------------------------------


def test_gc_remote_evicts_least_recently_used_blobs_no_young_record_names(s3_env, tmp_path):
    from cudabuild.engine.cache_admin import remote_gc_lines
    from cudabuild.engine.tiers.s3.gc import gc_remote

    url = s3_env.url("gc")
    tier = s3_tier(url, [])
    data = [os.urandom(1 << 20) for _ in range(4)]
    b1, b2, b3, b4 = shas = [sha_of(d) for d in data]
    for sha, d in zip(shas, data):
        assert tier.put_blob(sha, io.BytesIO(d))
        time.sleep(1.1)  # LastModified has whole seconds
    assert tier.put_record("young", dict(RECORD, outputs={"model.pte": b1}))
    assert s3_tier(url, []).get_blob_to_file(b2, tmp_path / "b2")  # a use: b2 is now the most recent
    limit = int(2.5 * (1 << 20))
    assert gc_remote(tier, limit).evicted == []  # everything was used within the hour
    later = time.time() + 10 * 86400
    report = gc_remote(tier, limit, keep_days=20, now=later)
    assert report.evicted == [b3, b4] and report.after == 2 << 20 and report.pinned == 1
    left = s3_env.keys(url)
    assert {k for k in left if k.startswith(("blobs/", "used/"))} == {f"{d}/{s}" for d in ("blobs", "used") for s in (b1, b2)}
    assert "evicted 2 blobs" in remote_gc_lines(report)[0]
    # Once the record is older than the kept days, it protects nothing.
    assert gc_remote(tier, 1 << 20, keep_days=5, now=later).evicted == [b1]


def test_gc_remote_from_the_command_line(s3_env, tmp_path):
    url = s3_env.url("gc-cli")
    data = os.urandom(5000)
    assert s3_tier(url, []).put_blob(sha_of(data), io.BytesIO(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDABUILD_")}
    env.update(CUDABUILD_REMOTE=url, CUDABUILD_CACHE_DIR=str(tmp_path / "cache"))
    env.update(CUDABUILD_PROJECT=str(tmp_path))  # an empty project of its own, whatever the checkout holds
    run = lambda *args: subprocess.run([sys.executable, "-m", "cudabuild", "cache", "gc", "--remote", *args], cwd=tmp_path,
                                       env=env, capture_output=True, text=True, timeout=600)
    done = run("--max-size", "1K", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"remote {url}: 1 blob" in done.stdout and "would evict 0 blobs" in done.stdout
    assert "used in the last hour are never evicted" in done.stdout
    assert f"blobs/{sha_of(data)}" in s3_env.keys(url)
    refused = run()
    assert refused.returncode == 2 and "needs --max-size SIZE" in refused.stderr


def test_gc_remote_with_records_on_redis_keeps_blobs_a_recently_used_record_names(server, s3_env):
    from cudabuild.engine.tiers.s3.gc import gc_remote

    blobs = s3_env.url("gc-hybrid")
    tier = factory.from_env({"CUDABUILD_REMOTE": server.url, "CUDABUILD_REMOTE_BLOBS": blobs})
    kept, dropped = os.urandom(2000), os.urandom(3000)
    for data in (kept, dropped):
        assert tier.put_blob(sha_of(data), io.BytesIO(data))
    assert tier.put_record("young", dict(RECORD, outputs={"model.pte": sha_of(kept)}))
    report = gc_remote(tier, 2500, now=time.time() + 7200)  # past the hour's grace; the record was used just now
    assert report.evicted == [sha_of(dropped)] and report.pinned == 1
    assert {k for k in s3_env.keys(blobs) if k.startswith("blobs/")} == {f"blobs/{sha_of(kept)}"}

"""The object-store tier under faults: a real SeaweedFS behind a TCP proxy (tests/_proxy.py) that
drops connections, cuts replies short, flips a byte of a reply, or goes down.

What must hold (issue 25): faults shorter than the retry budget cost nothing (every call answers,
every stage is served remote, nothing is said); a longer outage costs a few calls, one warning that
names the call and the kind of fault, and a local build; the next process uses the tier again.
Forked builders (doit's workers) never share a connection.
"""

from __future__ import annotations

import io
import os
from urllib.parse import urlsplit

import pytest

from _proxy import FaultyProxy
from _s3_server import BUCKET
from conftest import assert_ok, new_project
from cudabuild.engine.tiers import base, factory
from cudabuild.engine.tiers.s3.blobs import S3Blobs
from cudabuild.engine.tiers.s3.client import Bucket
from test_remote import BUILD, STAGES, forget_locally, sha_file, warning_lines  # noqa: F401
from test_remote_s3 import no_ambient_remote, seed, sha_of  # noqa: F401  (the autouse fixture too)


@pytest.fixture
def proxy(s3_env, monkeypatch):
    """A proxy in front of the session's SeaweedFS; this process's SDK talks to it."""
    parts = urlsplit(s3_env.endpoint)
    faulty = FaultyProxy(parts.hostname, parts.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", faulty.endpoint)
    yield faulty
    faulty.close()


def bucket(url: str, warnings: list) -> Bucket:
    """A new client, as a new build process has: no pooled connection yet."""
    return Bucket(url, warn=warnings.append)


def put_record_object(b: Bucket, name: str, body: bytes) -> None:
    assert b.call("put", lambda c: c.put_object(Bucket=b.bucket, Key=b.key(name), Body=body), write=True) is not base.UNREACHABLE


def test_short_faults_are_retried_and_nothing_is_said(s3_env, proxy, tmp_path):
    url, warnings = s3_env.url("short"), []
    body = b'{"record": "r"}' * 200
    blob = os.urandom(3 << 20)
    b = bucket(url, warnings)
    put_record_object(b, "rec/k", body)
    proxy.drop_next(2)  # the SDK's retries: 3 attempts
    assert S3Blobs(bucket(url, warnings)).put_blob(sha_of(blob), io.BytesIO(blob))
    for fault in (proxy.drop_next, proxy.cut_next, proxy.corrupt_next):
        fault(2)
        found = bucket(url, warnings).get_small(b.key("rec/k"), "record lookup")
        assert found is not base.UNREACHABLE and found[0] == body, fault.__name__
    proxy.garble_next(2)  # a reply that is not S3's (a 400 page, as to a garbled request)
    put_record_object(bucket(url, warnings), "rec/k2", body)
    proxy.cut_next(1)
    assert S3Blobs(bucket(url, warnings)).get_blob_to_file(sha_of(blob), tmp_path / "blob")
    assert (tmp_path / "blob").read_bytes() == blob
    assert proxy.faults_done == {"dropped": 4, "cut": 3, "corrupted": 2, "garbled": 2}
    assert warnings == []


def test_one_call_that_fails_is_a_miss_said_once_and_the_tier_stays(s3_env, proxy):
    url, warnings = s3_env.url("one-miss"), []
    b = bucket(url, [])
    put_record_object(b, "rec/k", b"{}")
    reader = bucket(url, warnings)
    proxy.drop_next(3)  # every attempt of the first call
    assert reader.get_small(b.key("rec/k"), "record lookup") is base.UNREACHABLE
    assert warnings == [] and not reader.down  # said once the outcome is known
    assert reader.get_small(b.key("rec/k"), "record lookup")[0] == b"{}"
    assert len(warnings) == 1
    assert "record lookup failed (dropped: " in warnings[0] and "served as a miss" in warnings[0], warnings
    assert reader.faults == {"dropped": 1}


def test_a_long_outage_is_given_up_after_a_few_calls_with_one_warning(s3_env, proxy):
    url, warnings = s3_env.url("outage"), []
    put_record_object(bucket(url, []), "rec/k", b"{}")
    proxy.down = True
    reader = bucket(url, warnings)
    for _ in range(10):
        assert reader.get_small(reader.key("rec/k"), "record lookup") is base.UNREACHABLE
    assert reader.down and reader.faults == {"dropped": base.FAILURES_TO_GIVE_UP}
    assert len(warnings) == 1, warnings
    assert f"after {base.FAILURES_TO_GIVE_UP} failed calls in a row (record lookup: dropped: " in warnings[0]
    assert "continuing with the local cache only (the next build tries it again)" in warnings[0]
    proxy.down = False
    assert bucket(url, warnings).get_small(reader.key("rec/k"), "record lookup")[0] == b"{}"  # the next build
    assert len(warnings) == 1


def test_forked_builders_each_talk_on_their_own_connection(s3_env):
    """doit's workers are forked from a process that already used the tier: a client shared across
    the fork had two processes write into one socket and read each other's replies (issue 25)."""
    url = s3_env.url("fork")
    b = Bucket(url, warn=lambda line: os.write(2, line.encode()))
    put_record_object(b, "warm", b"the parent's connection is pooled now")
    parent_client = b.client()
    children = []
    for i in range(2):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (a child)
            ok = b.client() is not parent_client
            for n in range(40):
                data = os.urandom(20000 + n)
                put_record_object(b, f"k{i}/{n}", data)
                found = b.get_small(b.key(f"k{i}/{n}"), "record lookup")
                ok &= isinstance(found, tuple) and found[0] == data
            os.write(write_end, b"ok" if ok and not b.faults else f"bad {b.faults}".encode())
            os._exit(0)
        os.close(write_end)
        children.append((pid, read_end))
    for pid, read_end in children:
        os.waitpid(pid, 0)
        assert os.read(read_end, 200) == b"ok"
    assert b.client() is parent_client and not b.faults


def test_a_reply_naming_another_key_is_never_served(s3_env):
    url, warnings = s3_env.url("other-key"), []
    tier = factory.from_env({"CUDABUILD_REMOTE": url}, warn=warnings.append)
    record = {"stage": "package", "digest": "d" * 64, "outputs": {"model.pte": "a" * 64}, "finals": ["model.pte"],
              "value": None, "seconds": 1.0}
    assert tier.put_record("k-one", record)
    client = s3_env.client()
    prefix = url.split("/", 3)[3]
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/rec/k-two",
                      Body=client.get_object(Bucket=BUCKET, Key=f"{prefix}/rec/k-one")["Body"].read())
    assert tier.get_record("k-one") == record and tier.get_record("k-two") is None
    assert len(warnings) == 1 and "names another key" in warnings[0]


@pytest.mark.slow
def test_builds_through_a_faulty_proxy(built_tiny, s3_env, tmp_path):
    """Faults within the budget: every stage remote, nothing said. An outage: a local build and one
    warning. Healed: the next build is served remote again."""
    url = s3_env.url("builds")
    assert seed(built_tiny, factory.from_env({"CUDABUILD_REMOTE": url})) == len(STAGES)
    parts = urlsplit(s3_env.endpoint)
    proxy = FaultyProxy(parts.hostname, parts.port)
    try:
        env = dict(s3_env.env(), AWS_ENDPOINT_URL=proxy.endpoint, CUDABUILD_REMOTE=url)
        fresh = new_project(tmp_path / "fresh")
        proxy.latency = 0.02
        proxy.drop_next(2)
        proxy.cut_next(2)
        result = fresh.export(*BUILD, env=fresh.env(**env))
        assert_ok(result)
        assert fresh.statuses() == {s: "remote" for s in STAGES}
        assert proxy.faults_done["dropped"] == 2 and proxy.faults_done["cut"] == 2
        assert not warning_lines(result)

        proxy.down = True
        forget_locally(fresh, "probe")  # the cheapest stage to run again; it has to be looked up remotely first
        result = fresh.export(*BUILD, env=fresh.env(**env))
        assert_ok(result)
        assert fresh.statuses()["probe"] == "ran"
        warned = warning_lines(result)
        assert len(warned) == 1 and "continuing with the local cache only" in warned[0], warned

        proxy.down = False
        forget_locally(fresh, "probe")
        result = fresh.export(*BUILD, env=fresh.env(**env))
        assert_ok(result)
        assert fresh.statuses()["probe"] == "remote" and not warning_lines(result)
    finally:
        proxy.close()

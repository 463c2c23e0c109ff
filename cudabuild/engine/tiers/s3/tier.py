"""Object-store-only mode: records, leases and blobs all in one S3-compatible bucket, no Redis.

    CUDABUILD_REMOTE=s3://BUCKET/PREFIX

The same tier as redis.RedisTier (the same base.Tier calls, signed envelopes and degrading), laid
out as objects under PREFIX:
- `blobs/<sha256>`, `used/<sha256>`  see blobs.py;
- `rec/<key>`    the record's signed JSON envelope (base.seal), written after every blob it names;
- `lease/<key>`  JSON {"token", "seconds"}: the build lease. Taken with a conditional write
  (`If-None-Match: *`: only one builder creates it), renewed by its holder's heartbeat with
  `If-Match` on the ETag it last wrote, released by a delete with `If-Match`. It has lapsed when
  the server's own clock (the Date of a reply) is more than `seconds` past its LastModified, so
  builders' clocks never matter; a waiter takes a lapsed lease over with `If-Match` on the stale
  ETag, so two waiters cannot both take it.

Servers that ignore or reject these conditional headers exist (older releases of S3-compatible
servers, some gateways; AWS S3 has honoured them since 2024). The first lease a builder needs checks the server once (a probe object
written twice with If-None-Match); where it fails, builders say so in one warning and build without
leases: results stay correct, but two builders may build the same key at the same time.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from typing import Callable, Optional

from cudabuild.engine.tiers.base import POLL_SECONDS, Lease, NoLease, Tier, lease_token, seal, warn_stderr
from cudabuild.engine.tiers.s3.blobs import S3Blobs
from cudabuild.engine.tiers.s3.client import MISSING, NOT_IMPLEMENTED, PRECONDITION, UNREACHABLE, Bucket, Refused


class S3Tier(Tier):
    def __init__(self, records: Bucket, *, blobs: Optional[S3Blobs] = None, secret: Optional[bytes] = None,
                 read_only: bool = False, lease_seconds: float = 60.0, wait_seconds: float = 3600.0,
                 warn: Callable[[str], None] = warn_stderr):
        self.records = records
        self.blobs = blobs or S3Blobs(records)
        self.where = records.where + (f" (blobs in {self.blobs.where})" if self.blobs.where != records.where else "")
        Tier.__init__(self, secret=secret, read_only=read_only, lease_seconds=lease_seconds,
                      wait_seconds=wait_seconds, warn=warn)
        self.blobs.stats = self.stats  # one set of counters per tier
        self.conditional_writes: Optional[bool] = None  # unknown until the first lease needs it

    @property
    def writable(self) -> bool:
        return not self.read_only and self.records.writable

    @property
    def down(self) -> bool:
        return self.records.down or self.blobs.bucket.down

    def warn_once(self, topic: str, message: str) -> None:
        self.records.warn_once(topic, message)

    def _rec_key(self, key: str) -> str:
        return self.records.key("rec", key)

    def _lease_key(self, key: str) -> str:
        return self.records.key("lease", key)

    # -- blobs ---------------------------------------------------------------------------------------

    def has_blobs(self, shas) -> bool:
        return self.blobs.has_blobs(shas)

    def put_blob(self, sha: str, source) -> bool:
        return self.writable and self.blobs.put_blob(sha, source)

    def get_blob_to_file(self, sha: str, dest) -> bool:
        return self.blobs.get_blob_to_file(sha, dest)

    # -- records -------------------------------------------------------------------------------------

    def get_record(self, key: str) -> Optional[dict]:
        """The record for an action key, when it is well formed and (with a secret) correctly signed."""
        found = self.records.get_small(self._rec_key(key), "record lookup")
        if found is UNREACHABLE or found is None:
            return None
        return self._unsealed(key, found[0])

    def put_record(self, key: str, record: dict) -> bool:
        """Publish a record; call it only once every blob it names is in the tier."""
        if not self.writable:
            return False
        body = seal(key, record, self.secret).encode()
        done = self.records.call("record upload", lambda c: c.put_object(
            Bucket=self.records.bucket, Key=self._rec_key(key), Body=body, ContentType="application/json"), write=True)
        if done is UNREACHABLE:
            return False
        self.stats["records_out"] += 1
        return True

    def young_records(self, keep_s: float, now: float) -> Optional[list[bytes]]:
        """The raw envelopes of the record objects written within keep_s seconds of `now`."""
        listing = self.records.listing(self.records.key("rec", ""), "record listing")
        if listing is None:
            return None
        keys = [o["Key"] for o in listing if now - o["LastModified"].timestamp() < keep_s]
        with ThreadPoolExecutor(8) as pool:
            found = list(pool.map(lambda key: self.records.get_small(key, "record lookup"), keys))
        return [f[0] for f in found if isinstance(f, tuple)]

    # -- build leases --------------------------------------------------------------------------------

    def _lease_body(self, token: str) -> bytes:
        # A fresh nonce per write: the ETag (an MD5 of the body) must change with every renewal.
        return json.dumps({"token": token, "seconds": self.lease_seconds, "nonce": uuid.uuid4().hex}).encode()

    def _lease_state(self, key: str):
        """("free" | "held" | "lapsed", etag of the lease object or None, its holder's token or None),
        or UNREACHABLE."""
        found = self.records.get_small(self._lease_key(key), "lease lookup")
        if found is UNREACHABLE:
            return UNREACHABLE
        if found is None:
            return "free", None, None
        body, etag, modified, date = found
        try:
            lease = json.loads(body)
            seconds, token = float(lease.get("seconds", self.lease_seconds)), lease.get("token")
        except (ValueError, TypeError, AttributeError):
            seconds, token = self.lease_seconds, None  # unreadable: it lapses like any other
        try:
            age = (parsedate_to_datetime(date) - modified).total_seconds()
        except (TypeError, ValueError):
            age = 0.0
        # Both times are whole seconds: one more second, so a lease renewed on time never looks lapsed.
        return ("lapsed" if age > seconds + 1 else "held"), etag, token

    def _put_lease(self, key: str, token: str, condition: dict):
        """The new lease object's ETag, Refused when the condition failed, or UNREACHABLE."""
        body = self._lease_body(token)
        reply = self.records.call("lease", lambda c: c.put_object(
            Bucket=self.records.bucket, Key=self._lease_key(key), Body=body, **condition),
            write=True, expect=PRECONDITION + MISSING + NOT_IMPLEMENTED)
        return reply if reply is UNREACHABLE or isinstance(reply, Refused) else reply["ETag"]

    def _conditional_writes_work(self) -> bool:
        """Whether the server honours If-None-Match on PUT; asked once per process, said once when not."""
        if self.conditional_writes is None:
            probe = self.records.key("lease", f".probe-{uuid.uuid4().hex}")

            def put(c):
                return c.put_object(Bucket=self.records.bucket, Key=probe, Body=b"probe", IfNoneMatch="*")

            first = self.records.call("conditional-write probe", put, write=True, expect=NOT_IMPLEMENTED + PRECONDITION)
            if first is UNREACHABLE:
                return False
            second = self.records.call("conditional-write probe", put, write=True, expect=NOT_IMPLEMENTED + PRECONDITION)
            if second is UNREACHABLE:
                return False
            self.records.delete(probe, "conditional-write probe")
            self.conditional_writes = (not isinstance(first, Refused) and isinstance(second, Refused)
                                       and second.code in PRECONDITION)
            if not self.conditional_writes:
                self.warn_once("conditional", f"remote store {self.where} does not honour conditional writes "
                                               "(If-None-Match); building without build-once leases: builders may "
                                               "build the same stage at the same time (results stay correct)")
        return self.conditional_writes

    def try_lease(self, key: str):
        """Claim the build of `key` across the fleet: a Lease, NoLease (cannot take leases, but nobody
        else holds one), or None when another builder holds it (then wait_for_result and restore)."""
        if not self.writable:
            state = self._lease_state(key)
            return None if state is not UNREACHABLE and state[0] == "held" else NoLease()
        if not self._conditional_writes_work():
            return NoLease()
        token = lease_token()
        etag = self._put_lease(key, token, {"IfNoneMatch": "*"})
        if etag is UNREACHABLE:
            return NoLease()
        if not isinstance(etag, Refused):
            return Lease(self, key, token, etag)
        state = self._lease_state(key)
        if state is UNREACHABLE:
            return NoLease()
        status, stale, holder = state
        if status == "held":
            # Ours after all when a retried write had landed the first time (its reply was lost).
            return Lease(self, key, token, stale) if holder == token else None
        # Gone since (released: create it again), or lapsed (take it over from the dead holder).
        condition = {"IfNoneMatch": "*"} if status == "free" else {"IfMatch": stale}
        etag = self._put_lease(key, token, condition)
        if etag is UNREACHABLE:
            return NoLease()
        return None if isinstance(etag, Refused) else Lease(self, key, token, etag)

    def _renew_lease(self, lease: Lease):
        etag = self._put_lease(lease.key, lease.token, {"IfMatch": lease.etag})
        if etag is UNREACHABLE:
            return UNREACHABLE
        if isinstance(etag, Refused):
            return False
        lease.etag = etag
        return True

    def _release_lease(self, lease: Lease) -> None:
        def delete(c):
            return c.delete_object(Bucket=self.records.bucket, Key=self._lease_key(lease.key), IfMatch=lease.etag)

        reply = self.records.call("lease release", delete, write=True, expect=PRECONDITION + MISSING + NOT_IMPLEMENTED)
        if isinstance(reply, Refused) and reply.code in NOT_IMPLEMENTED:  # no conditional deletes: look, then delete
            state = self._lease_state(lease.key)
            if state is not UNREACHABLE and state[1] == lease.etag:
                self.records.delete(self._lease_key(lease.key), "lease release")

    def wait_for_result(self, key: str, deadline: float) -> None:
        """Return once `key`'s record is published, its lease is gone or lapsed, the store is
        unreachable, or `deadline` (time.monotonic) has passed. Polls twice a second."""
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(POLL_SECONDS, left))
            published = self.records.exists(self._rec_key(key), "lease wait")
            if published is UNREACHABLE or published:
                return
            state = self._lease_state(key)
            if state is UNREACHABLE or state[0] != "held":
                return

    # -- inspection ----------------------------------------------------------------------------------

    def server_info(self) -> Optional[dict]:
        """What nightly.json records about the tier: where it is, and its blobs' count and bytes."""
        usage = self.blobs.usage()
        if usage is None:
            return None
        return {"store": self.where, "blobs": usage[0], "blob_bytes": usage[1],
                "conditional_writes": self.conditional_writes}

    def describe(self) -> list[str]:
        """The bucket's records and blobs, by listing them."""
        def records() -> str:
            listing = self.records.listing(self.records.key("rec", ""), "record listing")
            return f"{len(listing)} records, " if listing is not None else ""

        return [self.blobs.describe("remote cache", records)]

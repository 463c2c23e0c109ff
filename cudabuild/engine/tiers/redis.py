"""The shared tier on Redis: records, blobs and build leases in one Redis database.

    CUDABUILD_REMOTE=redis://HOST:PORT/DB            # also rediss://, unix://; a password goes in the URL

This module owns the Redis side: its key layout, chunked blob transfer checked against the sha256
on arrival, records in their signed envelopes (base.seal), per-key build leases with a heartbeat,
and degrading to the local cache alone when Redis fails (base.Degrading: a failed call is a miss,
3 in a row or an auth failure give Redis up for the process with one warning, then no more network
calls). With CUDABUILD_REMOTE_BLOBS set, blobs go to that store (s3/blobs.py) and
Redis keeps the records and leases. It never touches the local store or build/: the object store and the action cache decide
what to copy where, runner.py when to lease. `redis` is imported on the first call that talks to
the server, not before.

Keys (all under `cudabuild:`):
- `chunk:<sha>:<i>`  the i-th piece of a blob's bytes (at most `chunk_bytes` each);
- `blob:<sha>`       JSON {"size", "chunks", "chunk_bytes"}, written after every chunk: a reader that
                     finds it finds a whole blob, unless Redis evicted a chunk since, which is a miss;
- `rec:<key>`        JSON {"key", "record", "sig"}, written after every blob the record names;
- `lease:<key>`      the token of the builder building that key, with an expiry its heartbeat renews.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import BinaryIO, Callable, Iterable, Optional

from cudabuild.engine.tiers.base import (POLL_SECONDS, UNREACHABLE, BlobStore, Degrading, Lease,
                                         NoLease, Tier, lease_token, mib, redact, seal, warn_stderr)

PREFIX = "cudabuild:"
CHUNK_BYTES = 4 << 20
BATCH_CHUNKS = 8  # chunks per round trip: 32 MiB in flight at most
SOCKET_TIMEOUT = 2.0
CONNECT_TIMEOUT = 1.0

# Compare-and-act on a lease, so a builder whose lease lapsed and was taken over never renews or
# deletes the new holder's.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def fault_of(error: BaseException) -> tuple[str, bool]:
    """(kind, permanent) of a failed call, after redis-py's own retry: what the warning names, and
    whether the server is given up at once (Degrading counts the rest)."""
    import redis

    if isinstance(error, redis.exceptions.AuthenticationError):
        return "auth", True
    if isinstance(error, (redis.exceptions.TimeoutError, TimeoutError)):
        return "timeout", False
    if isinstance(error, ConnectionRefusedError) or "refused" in str(error).lower():
        return "refused", False
    if isinstance(error, (redis.exceptions.ConnectionError, ConnectionError)):
        return "dropped", False
    if isinstance(error, redis.exceptions.RedisError):
        return "bad reply", False
    return type(error).__name__, False


class RedisTier(Degrading, Tier):
    def __init__(self, url: str, *, secret: Optional[bytes] = None, read_only: bool = False,
                 lease_seconds: float = 60.0, wait_seconds: float = 3600.0, chunk_bytes: int = CHUNK_BYTES,
                 warn: Callable[[str], None] = warn_stderr, blobs: Optional[BlobStore] = None):
        Tier.__init__(self, secret=secret, read_only=read_only, lease_seconds=lease_seconds,
                      wait_seconds=wait_seconds, warn=warn)
        Degrading.__init__(self, warn)
        self.url = url
        # Blobs in an object store (s3.blobs.S3Blobs) instead of Redis chunks; records and leases stay here.
        self.blobs = blobs
        self.where = redact(url) + (f" (blobs in {blobs.where})" if blobs is not None else "")
        self.chunk_bytes = chunk_bytes
        self._client = None
        self._bad: set[str] = set()  # blobs this process found corrupt or incomplete remotely
        if blobs is not None:
            blobs.stats = self.stats  # one set of counters per tier

    # -- connection and degrading -------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        return not (self.read_only or self._down or self._writes_off)

    def _redis(self):
        if self._client is None:
            import redis
            from redis.backoff import ConstantBackoff
            from redis.retry import Retry

            # One quick retry, short timeouts: a dead Redis costs a build seconds, once.
            self._client = redis.Redis.from_url(
                self.url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT,
                retry=Retry(ConstantBackoff(0.1), 1),
            )
        return self._client

    def _call(self, what: str, fn, *, write: bool = False):
        """fn(client), or UNREACHABLE when the tier is down (or not writable, for a write)."""
        if self._down or (write and not self.writable):
            return UNREACHABLE
        import redis

        try:
            result = fn(self._redis())
        except redis.exceptions.ResponseError as e:  # e.g. OOM under maxmemory-policy noeviction
            self.refused(what, e, write=write)
            return UNREACHABLE
        except (redis.exceptions.RedisError, OSError) as e:
            kind, permanent = fault_of(e)
            self.failed(what, kind, e, permanent=permanent)
            return UNREACHABLE
        self.succeeded()
        return result

    # -- keys -------------------------------------------------------------------------------------

    @staticmethod
    def _blob_key(sha: str) -> str:
        return f"{PREFIX}blob:{sha}"

    @staticmethod
    def _chunk_key(sha: str, index: int) -> str:
        return f"{PREFIX}chunk:{sha}:{index}"

    @staticmethod
    def _rec_key(key: str) -> str:
        return f"{PREFIX}rec:{key}"

    @staticmethod
    def _lease_key(key: str) -> str:
        return f"{PREFIX}lease:{key}"

    # -- blobs --------------------------------------------------------------------------------------

    def has_blobs(self, shas: Iterable[str]) -> bool:
        """Whether the tier holds every one of these blobs (by their manifests: one round trip)."""
        if self.blobs is not None:
            return self.blobs.has_blobs(shas)
        shas = list(dict.fromkeys(shas))
        if any(sha in self._bad for sha in shas):
            return False
        if not shas:
            return True

        def check(r):
            pipe = r.pipeline(transaction=False)
            for sha in shas:
                pipe.exists(self._blob_key(sha))
            return all(pipe.execute())

        found = self._call("blob lookup", check)
        return found is not UNREACHABLE and bool(found)

    def put_blob(self, sha: str, source: BinaryIO) -> bool:
        """Upload a blob's bytes from `source`: every chunk, then the manifest. True when the tier holds it."""
        if not self.writable:
            return False
        if self.blobs is not None:
            return self.blobs.put_blob(sha, source)
        if self.has_blobs([sha]):
            return True

        def upload(r):
            h, size, index = hashlib.sha256(), 0, 0
            pipe = r.pipeline(transaction=False)
            while chunk := source.read(self.chunk_bytes):
                h.update(chunk)
                pipe.set(self._chunk_key(sha, index), chunk)
                size, index = size + len(chunk), index + 1
                if index % BATCH_CHUNKS == 0:
                    pipe.execute()
            pipe.execute()
            if h.hexdigest() != sha:  # the local copy changed under us: publish nothing
                return None
            r.set(self._blob_key(sha), json.dumps({"size": size, "chunks": index, "chunk_bytes": self.chunk_bytes}))
            return size

        size = self._call(f"upload of blob {sha[:12]}", upload, write=True)
        if size is UNREACHABLE or size is None:
            return False
        self._bad.discard(sha)
        self.stats["blobs_out"] += 1
        self.stats["bytes_out"] += size
        return True

    def get_blob_to_file(self, sha: str, dest: os.PathLike | str) -> bool:
        """Download a blob into `dest`; True only when every chunk arrived and the bytes hash to `sha`.

        A blob with a missing chunk (evicted) is a miss; one whose bytes do not match is reported,
        deleted from the tier when this builder may write, and not offered again in this process.
        """
        if self.blobs is not None:
            return self.blobs.get_blob_to_file(sha, dest)
        if sha in self._bad:
            return False

        def download(r):
            raw = r.get(self._blob_key(sha))
            if raw is None:
                return "missing", 0
            try:
                meta = json.loads(raw)
                size, chunks = int(meta["size"]), int(meta["chunks"])
            except (ValueError, KeyError, TypeError):
                return "corrupt", 0
            h, written = hashlib.sha256(), 0
            with open(dest, "wb") as out:
                for start in range(0, chunks, BATCH_CHUNKS):
                    keys = [self._chunk_key(sha, i) for i in range(start, min(chunks, start + BATCH_CHUNKS))]
                    for part in r.mget(keys):
                        if part is None:
                            return "incomplete", chunks
                        h.update(part)
                        out.write(part)
                        written += len(part)
            return ("ok" if written == size and h.hexdigest() == sha else "corrupt"), chunks

        outcome = self._call(f"download of blob {sha[:12]}", download)
        if outcome is UNREACHABLE:
            return False
        state, chunks = outcome
        if state == "ok":
            self.stats["blobs_in"] += 1
            self.stats["bytes_in"] += os.path.getsize(dest)
            return True
        if state in ("corrupt", "incomplete"):
            self._bad.add(sha)
            if state == "corrupt":
                self.warn(f"remote blob {sha[:12]} failed its sha256 check on arrival; "
                          f"{'deleted from' if self.writable else 'ignored in'} {self.where}, it will be rebuilt")
            self._drop_blob(sha, chunks)
        return False

    def _drop_blob(self, sha: str, chunks: int) -> None:
        if self.writable:
            keys = [self._blob_key(sha)] + [self._chunk_key(sha, i) for i in range(chunks)]
            self._call(f"delete of blob {sha[:12]}", lambda r: r.delete(*keys), write=True)

    # -- records -------------------------------------------------------------------------------------

    def get_record(self, key: str) -> Optional[dict]:
        """The record for an action key, when it is well formed and (with a secret) correctly signed."""
        raw = self._call("record lookup", lambda r: r.get(self._rec_key(key)))
        if raw is UNREACHABLE or raw is None:
            return None
        return self._unsealed(key, raw)

    def put_record(self, key: str, record: dict) -> bool:
        """Publish a record; call it only once every blob it names is in the tier."""
        sealed = seal(key, record, self.secret)
        done = self._call("record upload", lambda r: r.set(self._rec_key(key), sealed), write=True)
        if done is UNREACHABLE:
            return False
        self.stats["records_out"] += 1
        return True

    def young_records(self, keep_s: float, now: float) -> Optional[list[bytes]]:
        """The raw envelopes of the records read or written within keep_s seconds (by Redis's
        OBJECT IDLETIME, so `now` is not needed)."""
        def young(r):
            keys = list(r.scan_iter(match=self._rec_key("*"), count=1000))
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.object("idletime", key)
            idle = pipe.execute(raise_on_error=False)
            # No idle time (an LFU policy answers with an error): count the record as young.
            chosen = [k for k, t in zip(keys, idle) if not isinstance(t, int) or t < keep_s]
            raws = []
            for start in range(0, len(chosen), 500):
                raws.extend(r.mget(chosen[start:start + 500]))
            return raws

        found = self._call("record listing", young)
        return None if found is UNREACHABLE else [raw for raw in found if raw is not None]

    # -- build leases --------------------------------------------------------------------------------

    def try_lease(self, key: str):
        """Claim the build of `key` across the fleet.

        Returns a Lease (use it as a context manager around the build), NoLease when this builder
        cannot take leases (read-only, or Redis unreachable) but nobody else holds one, or None
        when another builder holds it: then `wait_for_result` and restore.
        """
        lease_key = self._lease_key(key)
        if not self.writable:
            held = self._call("lease lookup", lambda r: r.exists(lease_key))
            return None if held is not UNREACHABLE and held else NoLease()
        token = lease_token()
        got = self._call("lease", lambda r: r.set(lease_key, token, nx=True, px=int(self.lease_seconds * 1000)), write=True)
        if got is UNREACHABLE:
            return NoLease()
        return Lease(self, key, token) if got else None

    def _renew_lease(self, lease: Lease):
        millis = int(self.lease_seconds * 1000)
        return self._call("lease renewal", lambda r: r.eval(_RENEW, 1, self._lease_key(lease.key), lease.token, millis))

    def _release_lease(self, lease: Lease) -> None:
        self._call("lease release", lambda r: r.eval(_RELEASE, 1, self._lease_key(lease.key), lease.token))

    def wait_for_result(self, key: str, deadline: float) -> None:
        """Return once `key`'s record is published, its lease is gone (released, or lapsed with a
        dead holder), Redis is unreachable, or `deadline` (time.monotonic) has passed. Polls twice
        a second, and sleeps once before the first look, so a caller's retry loop never spins."""
        rec_key, lease_key = self._rec_key(key), self._lease_key(key)
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(POLL_SECONDS, left))
            state = self._call("lease wait", lambda r: r.pipeline(transaction=False).exists(rec_key).exists(lease_key).execute())
            if state is UNREACHABLE or state[0] or not state[1]:
                return

    # -- inspection ----------------------------------------------------------------------------------

    def server_info(self) -> Optional[dict]:
        """A few of the server's own numbers (memory, policy, evictions, keys), or None when down."""
        def info(r):
            data = r.info()
            return {name: data.get(name) for name in ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys",
                                                      "keyspace_hits", "keyspace_misses",
                                                      "total_net_input_bytes", "total_net_output_bytes")} | {"keys": r.dbsize()}

        found = self._call("info", info)
        if found is UNREACHABLE:
            return None
        if self.blobs is not None:
            found["blobs"] = self.blobs.where
        return found

    def describe(self) -> list[str]:
        """Redis's INFO in one line, and the blobs' store in another when they live elsewhere."""
        info = self.server_info()
        if info is None:
            return [f"remote cache {self.where}: unreachable"]
        limit = info.get("maxmemory") or 0
        lines = [f"remote cache {redact(self.url)}: Redis, {info['keys']} keys, "
                 f"{mib(info.get('used_memory') or 0)} used"
                 + (f" of {mib(limit)} ({info.get('maxmemory_policy')})" if limit else "")
                 + f", {info.get('evicted_keys') or 0} evicted keys"]
        if self.blobs is not None:
            lines.append(self.blobs.describe("  blobs in"))
        return lines

"""What every shared tier has in common, whatever server it talks to.

- settings: the names of the CUDABUILD_REMOTE* variables (factory.py reads them; a tier is handed
  their values) and `Tier`'s settings: signing secret, read-only, lease and wait times;
- health: `UNREACHABLE`, what a call returns when the server could not be asked (distinct from any
  reply), and `Degrading`: a server found down is not asked again by this process, one that refused
  a write gets no more writes, and each kind of trouble is said once, not once per blob;
- records: `seal` and `unseal`, the signed JSON envelope every tier stores a record in, checked on
  the way in with the `well_formed` the local store applies too;
- leases: `Lease` (held, renewed by a heartbeat while the build runs), `NoLease`, `lease_token`;
- `Tier`, the interface a backend implements, and `BlobStore`, what holds a tier's blobs elsewhere
  (CUDABUILD_REMOTE_BLOBS);
- `push_store`: seed a tier from a local store.

A backend is one module beside this one (redis.py, s3/) and one entry in factory.BACKENDS. It
imports this module, never the factory nor another backend. Nothing here talks to a server.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import json
import os
import socket
import sys
import threading
import uuid
from typing import BinaryIO, Callable, Iterable, Optional, Protocol
from urllib.parse import urlsplit, urlunsplit

from cudabuild.errors import one_line
from cudabuild.engine.hashing import canonical_json
from cudabuild.engine.records import well_formed  # the check the local store applies too

REMOTE_ENV = "CUDABUILD_REMOTE"
KEY_ENV = "CUDABUILD_REMOTE_KEY"
MODE_ENV = "CUDABUILD_REMOTE_MODE"
LEASE_ENV = "CUDABUILD_REMOTE_LEASE_SECONDS"
WAIT_ENV = "CUDABUILD_REMOTE_WAIT_SECONDS"
BLOBS_ENV = "CUDABUILD_REMOTE_BLOBS"
MODES = ("read-write", "read-only")

POLL_SECONDS = 0.5  # how often a waiter looks for another builder's result
# How long leaving a lease's block waits for a renewal in flight: two Redis socket timeouts and a second.
HEARTBEAT_JOIN_SECONDS = 5.0


def warn_stderr(message: str) -> None:
    """The warning a tier gives when its creator named no other: a line on stderr. A build hands its
    tiers the console's (cudabuild.engine.store), which reaches the terminal also while a stage's
    output goes to its log; a tier itself knows no console."""
    print(f"cudabuild: warning: {message}", file=sys.stderr, flush=True)


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- health ----------------------------------------------------------------------------------------


class _Unreachable:
    def __repr__(self):
        return "UNREACHABLE"


UNREACHABLE = _Unreachable()


# A server is given up by this process after this many calls in a row failed, each after the
# client's own retries: one transient fault (a timeout, a checksum mismatch) costs one miss, not
# the rest of the build's sharing; an outage costs a few calls, then none.
FAILURES_TO_GIVE_UP = 3


class Degrading:
    """A server's health as this process sees it: up, failing (a few calls in a row failed), or down.

    A call that failed is reported to `failed` with the kind of fault (timeout, refused, checksum
    mismatch, auth, ...). A permanent fault (no credentials, no such bucket) takes the server down
    at once; a transient one counts, and FAILURES_TO_GIVE_UP in a row take it down. Down, it is not
    asked again by this process (the next build asks again). Each outcome is said in one line:
    "unreachable"/"given up" when it goes down, or, when the server answers again after a failure
    (or the process ends first), which call failed and why, served as a miss. A refused write
    turns this process's writes off.
    """

    noun = "remote cache"  # how warnings name the server: "remote cache <where> ..."

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn
        self._state = threading.Lock()
        self._down = False
        self._writes_off = False
        self._warned: set[str] = set()
        self._failures_in_a_row = 0
        self._unsaid: dict[str, str] = {}  # kind of fault -> its line, said once the outcome is known
        self.faults: dict[str, int] = {}  # kind of fault -> calls that failed with it (stats, tests)

    @property
    def down(self) -> bool:
        """Whether this process has given the server up (its one warning said so)."""
        return self._down

    def warn_once(self, topic: str, message: str) -> None:
        with self._state:
            if topic in self._warned:
                return
            self._warned.add(topic)
        self.warn(message)

    def succeeded(self) -> None:
        """A call got an answer: the failures before it were transient, and are said now."""
        if self._failures_in_a_row == 0:
            return
        with self._state:
            self._failures_in_a_row = 0
            unsaid, self._unsaid = self._unsaid, {}
        for kind, line in unsaid.items():
            self.warn_once(f"failed:{kind}", line)

    def failed(self, what: str, kind: str, error: BaseException, *, permanent: bool = False, hint: str = "") -> None:
        """A call failed with a fault of `kind` after the client's retries (see the class docstring)."""
        with self._state:
            self.faults[kind] = self.faults.get(kind, 0) + 1
            self._failures_in_a_row += 1
            gives_up = permanent or self._failures_in_a_row >= FAILURES_TO_GIVE_UP
            if not gives_up:
                self._unsaid.setdefault(kind, f"{self.noun} {self.where}: {what} failed ({kind}: {one_line(error)}); "
                                              "served as a miss, the store answered again after it")
                _say_at_exit(self)
                return
            self._down = True
            self._unsaid.clear()
            in_a_row = "" if permanent or self._failures_in_a_row == 1 else f" after {self._failures_in_a_row} failed calls in a row"
        state = "unreachable" if kind in ("refused", "timeout") else "given up"
        self.warn_once("down", f"{self.noun} {self.where} {state}{in_a_row} ({what}: {kind}: {one_line(error)}){hint}; "
                               "continuing with the local cache only (the next build tries it again)")

    def say_unsaid(self) -> None:
        """Say the failures not said yet (the process ends before the server answered again)."""
        with self._state:
            unsaid, self._unsaid = self._unsaid, {}
        for kind, line in unsaid.items():
            self.warn_once(f"failed:{kind}", line.replace("the store answered again after it", "the last calls of this process"))

    def refused(self, what: str, error: BaseException, *, write: bool) -> None:
        """The server answered no (a Redis out of memory, a 403): a refused write turns this
        process's writes off; a refused read is only said."""
        if write:
            self._writes_off = True
            self.warn_once("writes", f"{self.noun} {self.where} refused a write ({what}: {one_line(error)}); "
                                     "this build writes nothing more to it")
        else:
            self.warn_once("reads", f"{self.noun} {self.where} refused a read ({what}: {one_line(error)})")


def _say_at_exit(server: Degrading) -> None:
    """Say `server`'s unsaid failures when this process ends: at exit for the main process, and in
    a doit worker (a multiprocessing child, which leaves by os._exit) through multiprocessing's
    own exit hooks."""
    if getattr(server, "_exit_hook_pid", None) == os.getpid():
        return
    server._exit_hook_pid = os.getpid()
    import multiprocessing.util

    multiprocessing.util.Finalize(server, server.say_unsaid, exitpriority=10)


# -- records -----------------------------------------------------------------------------------------


def seal(key: str, record: dict, secret: Optional[bytes]) -> str:
    """A record as the remote tiers store it: JSON {"key", "record", "sig"} (sig with a secret only)."""
    envelope = {"key": key, "record": record}
    if secret is not None:
        envelope["sig"] = _signature(secret, key, record)
    return json.dumps(envelope, sort_keys=True)


def _signature(secret: bytes, key: str, record: dict) -> str:
    return hmac.new(secret, canonical_json({"key": key, "record": record}).encode(), hashlib.sha256).hexdigest()


def unseal(key: str, raw, secret: Optional[bytes], where: str, warn_once) -> Optional[dict]:
    """The record in a stored envelope, when it is valid JSON, well formed and (with a secret)
    correctly signed for `key`; else None, with one warning per kind of fault."""
    try:
        envelope = json.loads(raw)
        record = envelope["record"]
    except (ValueError, KeyError, TypeError):
        warn_once("malformed", f"remote record for {key[:12]} in {where} is not valid JSON; ignored")
        return None
    if secret is not None:
        sig = envelope.get("sig")
        if not (isinstance(sig, str) and envelope.get("key") == key and hmac.compare_digest(sig, _signature(secret, key, record))):
            warn_once("signature", f"remote record for {key[:12]} in {where} is "
                                   f"{'unsigned' if sig is None else 'badly signed'}; ignored "
                                   f"(its builder must sign with the same {KEY_ENV})")
            return None
    if envelope.get("key") != key:  # another key's record (a reply meant for another request): never served
        warn_once("malformed", f"remote record for {key[:12]} in {where} names another key; ignored")
        return None
    if not well_formed(record):
        warn_once("malformed", f"remote record for {key[:12]} in {where} is malformed; ignored")
        return None
    return record


# -- leases ------------------------------------------------------------------------------------------


class NoLease:
    """Stands for a lease where none can be taken (read-only mode, the server down): builds go ahead."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def release(self) -> None:
        pass


class Lease:
    """A held build lease: renewed by a heartbeat thread while the block runs, released after.

    The tier does the talking (`_renew_lease`, `_release_lease`), so the same lease serves every
    backend; `etag` is the object store's handle on the lease object it wrote."""

    def __init__(self, tier: Tier, key: str, token: str, etag: Optional[str] = None):
        self.tier, self.key, self.token, self.etag = tier, key, token, etag
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.key[:8]}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_JOIN_SECONDS)
        self.release()
        return False

    def _heartbeat(self) -> None:
        tier = self.tier
        while not self._stop.wait(tier.lease_seconds / 3):
            kept = tier._renew_lease(self)
            if kept is UNREACHABLE:
                return
            if not kept:
                tier.warn_once(f"lease:{self.key}", f"the build lease on {self.key[:12]} lapsed; another builder may build it too")
                return

    def release(self) -> None:
        self.tier._release_lease(self)


def lease_token() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# -- the interface -----------------------------------------------------------------------------------


class BlobStore(Protocol):
    """Where a tier keeps its blobs when they live elsewhere (s3.blobs.S3Blobs): by sha256, each
    checked against it on arrival. The tier hands it its blob calls and shares its counters."""

    where: str
    stats: dict
    writable: bool

    def has_blobs(self, shas: Iterable[str]) -> bool: ...

    def put_blob(self, sha: str, source: BinaryIO) -> bool: ...

    def get_blob_to_file(self, sha: str, dest: os.PathLike | str) -> bool: ...

    def describe(self, head: str, records: Callable[[], str] = lambda: "") -> str: ...


class Tier(abc.ABC):
    """One shared tier behind the local store: records, blobs and build leases on one server.

    The object store and the action cache read through it and write back to it (cudabuild.engine.object_store,
    action_cache), the runner leases
    keys on it (executors.InProcess.claim), `cache stats`, `cache gc --remote` and nightly.json inspect it. A
    call that cannot reach the server returns what a miss returns (None, False, NoLease), after one
    warning; no call raises for the server's sake. `where` names it in messages, without a password.
    """

    where: str

    def __init__(self, *, secret: Optional[bytes], read_only: bool, lease_seconds: float, wait_seconds: float,
                 warn: Callable[[str], None]):
        self.secret = secret
        self.read_only = read_only
        self.lease_seconds = lease_seconds
        self.wait_seconds = wait_seconds
        self.warn = warn
        # What crossed the wire, read by `cache stats` and the benchmarks.
        self.stats = {"records_in": 0, "records_out": 0, "blobs_in": 0, "blobs_out": 0, "bytes_in": 0, "bytes_out": 0}

    def _unsealed(self, key: str, raw) -> Optional[dict]:
        """The record in an envelope read from the server (see unseal), counted as one in."""
        record = unseal(key, raw, self.secret, self.where, self.warn_once)
        if record is not None:
            self.stats["records_in"] += 1
        return record

    @property
    @abc.abstractmethod
    def writable(self) -> bool:
        """Whether this builder may write now: not read-only, and the server has not refused a write."""

    @property
    def down(self) -> bool:
        """Whether this process has given the server up (Degrading.down), which its own warning
        said once: what fails after it needs no line of its own."""
        return False

    @abc.abstractmethod
    def warn_once(self, topic: str, message: str) -> None: ...

    # -- blobs

    @abc.abstractmethod
    def has_blobs(self, shas: Iterable[str]) -> bool:
        """Whether the tier holds every one of these blobs."""

    @abc.abstractmethod
    def put_blob(self, sha: str, source: BinaryIO) -> bool:
        """Upload a blob's bytes from `source`; True when the tier holds it, never a blob whose bytes are not `sha`."""

    @abc.abstractmethod
    def get_blob_to_file(self, sha: str, dest: os.PathLike | str) -> bool:
        """Download a blob into `dest`; True only when the bytes that arrived hash to `sha`."""

    # -- records

    @abc.abstractmethod
    def get_record(self, key: str) -> Optional[dict]:
        """The record for an action key, when it is well formed and (with a secret) correctly signed (unseal)."""

    @abc.abstractmethod
    def put_record(self, key: str, record: dict) -> bool:
        """Publish a record (seal); call it only once every blob it names is in the tier."""

    @abc.abstractmethod
    def young_records(self, keep_s: float, now: float) -> Optional[list]:
        """The raw envelopes of the records written or used within `keep_s` seconds (what
        `cache gc --remote` must keep the blobs of), or None when the tier cannot be listed."""

    # -- build leases

    @abc.abstractmethod
    def try_lease(self, key: str):
        """Claim the build of `key` across the fleet: a Lease (use it as a context manager around
        the build), NoLease when this builder cannot take leases but nobody else holds one, or None
        when another builder holds it: then `wait_for_result` and restore."""

    @abc.abstractmethod
    def wait_for_result(self, key: str, deadline: float) -> None:
        """Return once `key`'s record is published, its lease is gone or lapsed, the server is
        unreachable, or `deadline` (time.monotonic) has passed; sleeps before the first look."""

    @abc.abstractmethod
    def _renew_lease(self, lease: Lease):
        """True when renewed, False when the lease is no longer this builder's, or UNREACHABLE."""

    @abc.abstractmethod
    def _release_lease(self, lease: Lease) -> None: ...

    # -- inspection

    @abc.abstractmethod
    def server_info(self) -> Optional[dict]:
        """A few of the server's own numbers, for nightly.json; None when it is unreachable."""

    @abc.abstractmethod
    def describe(self) -> list[str]:
        """What `cudabuild cache stats` says about the tier: where it is and what it holds."""


def push_store(store, tier: Optional[Tier] = None) -> int:
    """Copy every complete record of a local store, with its blobs, to the tier (e.g. to seed a new
    Redis from a machine that already built). Returns how many records were published."""
    tier = tier or store.remote
    published = 0
    for key, record in store.actions.records():
        if store.actions.push(key, record, tier):
            published += 1
    for key, record in store.actions.shared_docs():  # what the recipes declare: a fresh machine needs no torch
        tier.put_record(key, record)
    return published

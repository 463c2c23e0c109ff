"""One S3-compatible bucket, as the remote tiers talk to it: the client, and degrading on failure.

    CUDABUILD_REMOTE_BLOBS=s3://BUCKET/PREFIX        # blobs there (records and leases stay on Redis)
    CUDABUILD_REMOTE=s3://BUCKET/PREFIX              # everything there (object-store-only mode)

The endpoint, region and credentials are the AWS SDK's own business: AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3), AWS_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE and
~/.aws/config are read by boto3 as for any other tool; cudabuild adds no variables of its own.
boto3 is imported on the first call that talks to the server, so a build that needs no remote
object (a no-op) neither imports it nor makes a network call.

This module owns the client and the rule for failures (base.Degrading):
- One client per process. doit's workers are forked from the process that read the recipes
  through the tier, and a boto3 client's pooled keep-alive sockets must not cross a fork: two
  processes writing requests into one socket and reading each other's replies is what made
  uploads fail with BadDigest (the server hashed bytes from two bodies), lookups fail their CRC
  (another process had read the body), and reads time out (issue 25).
- Retries are the SDK's own (its `standard` mode, 3 attempts, unless the user's AWS_RETRY_MODE /
  AWS_MAX_ATTEMPTS / ~/.aws/config say otherwise): timeouts, resets, 5xx and throttling. What the
  SDK does not retry, because it happens after the reply began (a body cut short, a checksum
  mismatch either way), is retried here, OP_ATTEMPTS times in all: every call here is idempotent.
- Checksums are the SDK's defaults, or the user's request_checksum_calculation /
  response_checksum_validation: cudabuild sets none. What it serves is checked on its own terms
  anyway (a blob's sha256, a record's key and signature).
- A call that still fails is a miss, with its fault's kind named (timeout, refused, dropped,
  checksum mismatch, throttled, server error, auth, no bucket); FAILURES_TO_GIVE_UP in a row, or
  one permanent fault (auth, no bucket), give the store up for this process. A write the store
  refuses (access denied) stops writes, also with one warning.
It knows no key layout: blobs.py (blobs) and tier.py (records, leases) do.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Optional
from urllib.parse import urlsplit

from cudabuild.engine.tiers.base import UNREACHABLE, Degrading
from cudabuild.errors import InvalidRemote

SCHEME = "s3"
CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 60.0  # one socket read; a multi-GB part streams in many of them

MISSING = ("404", "NoSuchKey", "NotFound")
PRECONDITION = ("412", "PreconditionFailed")
# What a server that does not implement a conditional header may answer with.
NOT_IMPLEMENTED = ("501", "NotImplemented", "InvalidArgument", "InvalidRequest")

OP_ATTEMPTS = 3  # tries of one call for the faults the SDK does not retry (see the module docstring)
RETRY_PAUSE_S = 0.2  # times the attempt number, between them

CHECKSUM_CODES = ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum")
THROTTLE_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests")
AUTH_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "AuthorizationHeaderMalformed")


def fault_of(error: BaseException, code: str = "", status: int = 0) -> tuple[str, bool, bool]:
    """(kind, permanent, retry here) of a failed call: what warnings name, whether the store is
    given up at once, and whether this module tries the call again (the SDK retried the rest)."""
    import botocore.exceptions as bce

    if isinstance(error, bce.ClientError):
        if code in CHECKSUM_CODES:
            return "checksum mismatch", False, True
        if code in AUTH_CODES or status == 401:
            return "auth", True, False
        if code == "NoSuchBucket":
            return "no such bucket", True, False
        if code in THROTTLE_CODES or status == 429:
            return "throttled", False, False
        if status >= 500:
            return "server error", False, False
        return f"error reply {code or status}", False, True
    if isinstance(error, bce.FlexibleChecksumError):
        return "checksum mismatch", False, True
    if isinstance(error, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return "auth", True, False
    if isinstance(error, (bce.ConnectTimeoutError, bce.ReadTimeoutError, TimeoutError)):
        return "timeout", False, False
    if isinstance(error, (bce.EndpointConnectionError, ConnectionRefusedError)):
        return "refused", False, False
    if isinstance(error, (bce.ResponseStreamingError, bce.IncompleteReadError)):
        return "dropped", False, True  # the reply was cut short after it began
    if type(error).__name__ == "ResponseParserError":
        return "bad reply", False, True  # not S3's XML (a proxy's page, a garbled stream)
    if isinstance(error, (bce.ConnectionClosedError, ConnectionError, bce.ConnectionError)):
        return "dropped", False, False
    return type(error).__name__, False, False




class Refused:
    """An error reply the caller said it expects (a missing key, a failed precondition)."""

    def __init__(self, code: str, status: int):
        self.code, self.status = code, status

    def __repr__(self):
        return f"Refused({self.code}, {self.status})"


def parse_url(url: str, where: str) -> tuple[str, str]:
    """(bucket, prefix) of s3://BUCKET/PREFIX; the prefix without its slashes, possibly empty."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME or not parts.netloc or parts.query or parts.fragment:
        raise InvalidRemote(f"{where}={url} is not an S3 URL; expected s3://BUCKET/PREFIX "
                            "(endpoint and credentials come from AWS_ENDPOINT_URL, AWS_PROFILE, ...)")
    return parts.netloc, parts.path.strip("/")


class Bucket(Degrading):
    """A bucket and a key prefix, reached through boto3, that degrades to "unreachable" on failure."""

    noun = "remote store"

    def __init__(self, url: str, *, read_only: bool = False, warn: Callable[[str], None]):
        self.bucket, self.prefix = parse_url(url, "S3 URL")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.where = self.url
        Degrading.__init__(self, warn)
        self.read_only = read_only
        self._client = None
        self._client_pid = 0

    @property
    def writable(self) -> bool:
        return not (self.read_only or self._down or self._writes_off)

    def key(self, *names: str) -> str:
        return "/".join((self.prefix, *names) if self.prefix else names)

    def client(self):
        """This process's boto3 client (a forked child makes its own: see the module docstring)."""
        with self._state:
            if self._client is None or self._client_pid != os.getpid():
                import boto3
                from botocore.config import Config

                # Short connect timeout: a dead store costs a build seconds. Retries and checksums
                # are left to the SDK's defaults and the user's own AWS settings.
                config = Config(connect_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT, max_pool_connections=16)
                self._client = boto3.session.Session().client("s3", config=config)
                self._client_pid = os.getpid()
            return self._client

    def call(self, what: str, fn, *, write: bool = False, expect: Iterable[str] = ()):
        """fn(client), or Refused for an error reply named in `expect`, or UNREACHABLE when the store
        is down, the call failed (see the module docstring), or (for a write) it is not writable."""
        if self._down or (write and not self.writable):
            return UNREACHABLE
        try:
            import botocore.exceptions as bce
            from botocore.parsers import ResponseParserError  # a reply that is not S3's XML
        except ImportError:
            self._down = True
            self.warn_once("down", f"remote store {self.where} needs boto3 (pip install boto3); "
                                   "continuing with the local cache only")
            return UNREACHABLE
        for attempt in range(1, OP_ATTEMPTS + 1):
            try:
                found = fn(self.client())
            except bce.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if code in expect or str(status) in expect:
                    self.succeeded()
                    return Refused(code or str(status), status)
                if code in ("AccessDenied", "403") or status == 403:
                    self.succeeded()  # it answered
                    self.refused(what, e, write=write)
                    return UNREACHABLE
                kind, permanent, again = fault_of(e, code, status)
                error = e
            except (bce.BotoCoreError, OSError, ResponseParserError) as e:  # no connection, timeouts, bodies cut short, ...
                kind, permanent, again = fault_of(e)
                error = e
            else:
                self.succeeded()
                return found
            if not (again and attempt < OP_ATTEMPTS):
                break
            time.sleep(RETRY_PAUSE_S * attempt)
        self.failed(what, kind, error, permanent=permanent,
                    hint="; create the bucket first" if kind == "no such bucket" else "")
        return UNREACHABLE

    # -- small objects ------------------------------------------------------------------------------

    def get_small(self, key: str, what: str):
        """(bytes, etag, last_modified, server_date) of a small object; None when absent; UNREACHABLE."""
        def get(c):
            reply = c.get_object(Bucket=self.bucket, Key=key)
            body = reply["Body"].read()
            date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            return body, reply.get("ETag"), reply.get("LastModified"), date

        found = self.call(what, get, expect=MISSING)
        return None if isinstance(found, Refused) else found

    def exists(self, key: str, what: str):
        """True, False, or UNREACHABLE."""
        found = self.call(what, lambda c: c.head_object(Bucket=self.bucket, Key=key), expect=MISSING)
        return found if found is UNREACHABLE else not isinstance(found, Refused)

    def listing(self, prefix: str, what: str) -> Optional[list[dict]]:
        """Every object under `prefix` ({"Key", "Size", "LastModified", ...}); None when unreachable."""
        def walk(c):
            out = []
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                out.extend(page.get("Contents", []))
            return out

        found = self.call(what, walk)
        return None if found is UNREACHABLE else found

    def delete(self, key: str, what: str) -> bool:
        return self.call(what, lambda c: c.delete_object(Bucket=self.bucket, Key=key), write=True) is not UNREACHABLE

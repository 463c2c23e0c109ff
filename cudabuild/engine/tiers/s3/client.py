"""One S3-compatible bucket, as the remote tiers talk to it: the client, and degrading on failure.

    CUDABUILD_REMOTE_BLOBS=s3://BUCKET/PREFIX        # blobs there (records and leases stay on Redis)
    CUDABUILD_REMOTE=s3://BUCKET/PREFIX              # everything there (object-store-only mode)

The endpoint, region and credentials are the AWS SDK's own business: AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3), AWS_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE and
~/.aws/config are read by boto3 as for any other tool; cudabuild adds no variables of its own.
boto3 is imported on the first call that talks to the server, so a build that needs no remote
object (a no-op) neither imports it nor makes a network call.

This module owns the client and the rule for failures: a store that cannot be reached (refused,
timed out, no credentials, no such bucket) costs one warning, then no more calls in this process; a
write the store refuses (access denied) stops writes, also with one warning. It knows no key layout:
blobs.py (blobs) and tier.py (records, leases) do.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional
from urllib.parse import urlsplit

from cudabuild.engine.tiers.base import UNREACHABLE, Degrading
from cudabuild.errors import InvalidRemote, one_line

SCHEME = "s3"
CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 60.0  # one socket read; a multi-GB part streams in many of them

MISSING = ("404", "NoSuchKey", "NotFound")
PRECONDITION = ("412", "PreconditionFailed")
# What a server that does not implement a conditional header may answer with.
NOT_IMPLEMENTED = ("501", "NotImplemented", "InvalidArgument", "InvalidRequest")




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

    def __init__(self, url: str, *, read_only: bool = False, warn: Callable[[str], None], environ=os.environ):
        self.bucket, self.prefix = parse_url(url, "S3 URL")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.where = self.url
        Degrading.__init__(self, warn)
        self.read_only = read_only
        self._environ = environ
        self._client = None

    @property
    def writable(self) -> bool:
        return not (self.read_only or self._down or self._writes_off)

    @property
    def down(self) -> bool:
        return self._down

    def key(self, *names: str) -> str:
        return "/".join((self.prefix, *names) if self.prefix else names)

    def client(self):
        with self._state:
            if self._client is None:
                import boto3
                from botocore.config import Config

                # Short connect timeout, few retries: a dead store costs a build seconds, once. A user
                # who sets the SDK's own retry variables gets those instead.
                retries = None
                if not (self._environ.get("AWS_MAX_ATTEMPTS") or self._environ.get("AWS_RETRY_MODE")):
                    retries = {"mode": "standard", "max_attempts": 2}
                config = Config(connect_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT, retries=retries,
                                max_pool_connections=16)
                self._client = boto3.session.Session().client("s3", config=config)
            return self._client

    def call(self, what: str, fn, *, write: bool = False, expect: Iterable[str] = ()):
        """fn(client), or Refused for an error reply named in `expect`, or UNREACHABLE when the store
        is down, refuses, or (for a write) is not writable."""
        if self._down or (write and not self.writable):
            return UNREACHABLE
        try:
            import botocore.exceptions as bce
        except ImportError:
            self._down = True
            self.warn_once("down", f"remote store {self.where} needs boto3 (pip install boto3); "
                                   "continuing with the local cache only")
            return UNREACHABLE
        try:
            return fn(self.client())
        except bce.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in expect or str(status) in expect:
                return Refused(code or str(status), status)
            return self._failed(what, e, code, status, write)
        except (bce.BotoCoreError, OSError) as e:  # no connection, timeouts, no credentials
            self._go_down(what, e)
            return UNREACHABLE

    def _failed(self, what: str, error, code: str, status: int, write: bool):
        if code in ("AccessDenied", "403") or status == 403:
            self.refused(what, error, write=write)
            return UNREACHABLE
        self._go_down(what, error, hint="; create the bucket first" if code == "NoSuchBucket" else "")
        return UNREACHABLE

    def _go_down(self, what: str, error, hint: str = "") -> None:
        self._down = True
        self.warn_once("down", f"remote store {self.where} unreachable ({what}: {one_line(error)}){hint}; "
                               "continuing with the local cache only")

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

"""Which shared tier the environment names: `from_env` reads the CUDABUILD_REMOTE* variables,
checks them together (every problem in one InvalidRemote), and builds the tier through the
backend that the URL's scheme names in BACKENDS.

    CUDABUILD_REMOTE=redis://HOST:PORT/DB            # read-through, write-back, build-once leases (redis.py)
    CUDABUILD_REMOTE_BLOBS=s3://BUCKET/PREFIX        # blobs in an object store (s3/blobs.py), not in Redis
    CUDABUILD_REMOTE=s3://BUCKET/PREFIX              # object-store-only mode (s3/tier.py): no Redis at all
    CUDABUILD_REMOTE_KEY=SECRET                      # sign records (HMAC-SHA256); reject unsigned ones
    CUDABUILD_REMOTE_MODE=read-only                  # untrusted builders (pull-request CI): never write
    CUDABUILD_REMOTE_LEASE_SECONDS=60                # a dead builder's lease lapses after this
    CUDABUILD_REMOTE_WAIT_SECONDS=3600               # the longest a builder waits on another's lease

It talks to no server, and imports a backend's module only once its scheme is configured (so
neither redis nor boto3 before a call needs them). A new backend is a module beside redis.py and
one `Backend` entry below; no backend imports this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional
from urllib.parse import urlsplit

from cudabuild.errors import InvalidRemote
from cudabuild.engine.tiers.base import (BLOBS_ENV, KEY_ENV, LEASE_ENV, MODE_ENV, MODES, REMOTE_ENV, WAIT_ENV, BlobStore,
                                         Tier, redact, warn_stderr)


@dataclass(frozen=True)
class Backend:
    """One kind of server a shared tier can live on.

    `tier(url, settings, blobs, environ)` builds the tier (settings: base.Tier's keyword arguments;
    blobs: the CUDABUILD_REMOTE_BLOBS store, or None); `check(url, variable)` raises InvalidRemote
    for a URL the backend cannot use, without importing its client library; `blobs(url, settings,
    environ)`, for a backend that can hold another tier's blobs, builds that store.
    """

    noun: str  # how messages name its URLs: "a Redis URL"
    example: str  # "redis://HOST:PORT/DB"
    tier: Callable[[str, dict, Optional[BlobStore], Mapping], Tier]
    check: Callable[[str, str], None] = lambda url, variable: None
    blobs: Optional[Callable[[str, dict, Mapping], BlobStore]] = None


def _redis_tier(url: str, settings: dict, blobs: Optional[BlobStore], environ: Mapping) -> Tier:
    from cudabuild.engine.tiers.redis import RedisTier

    return RedisTier(url, blobs=blobs, **settings)


def _s3_check(url: str, variable: str) -> None:
    from cudabuild.engine.tiers.s3.client import parse_url  # no boto3 here

    parse_url(url, variable)


def _s3_blobs(url: str, settings: dict, environ: Mapping) -> BlobStore:
    from cudabuild.engine.tiers.s3.blobs import S3Blobs
    from cudabuild.engine.tiers.s3.client import Bucket

    return S3Blobs(Bucket(url, read_only=settings["read_only"], warn=settings["warn"]))


def _s3_tier(url: str, settings: dict, blobs: Optional[BlobStore], environ: Mapping) -> Tier:
    from cudabuild.engine.tiers.s3.client import Bucket
    from cudabuild.engine.tiers.s3.tier import S3Tier

    blobs = blobs or _s3_blobs(url, settings, environ)
    records = Bucket(url, read_only=settings["read_only"], warn=settings["warn"])
    if blobs.bucket.url == records.url:
        records = blobs.bucket  # one client, one warning, when both live in the same place
    return S3Tier(records, blobs=blobs, **settings)


_REDIS = Backend("a Redis URL", "redis://HOST:PORT/DB", _redis_tier)
_S3 = Backend("an s3:// URL", "s3://BUCKET/PREFIX", _s3_tier, check=_s3_check, blobs=_s3_blobs)

# URL scheme -> the backend that serves it, in the order messages list them.
BACKENDS: dict[str, Backend] = {"redis": _REDIS, "rediss": _REDIS, "unix": _REDIS, "s3": _S3}


def _seconds(environ, name: str, default: float, problems: list[str]) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        problems.append(f"{name}={raw} is not a positive number of seconds")
        return default
    return value


def _expected(backends) -> tuple[str, str]:
    """("a Redis URL nor an s3:// URL", "redis://HOST:PORT/DB or s3://BUCKET/PREFIX")."""
    distinct = list(dict.fromkeys(backends))
    return " nor ".join(b.noun for b in distinct), " or ".join(b.example for b in distinct)


def from_env(environ=os.environ, warn: Callable[[str], None] = warn_stderr) -> Optional[Tier]:
    """The tier $CUDABUILD_REMOTE names, with its blobs in $CUDABUILD_REMOTE_BLOBS when that is
    set; None when neither is set. Talks to no server.

    $CUDABUILD_REMOTE_BLOBS alone is refused rather than ignored: it moves another tier's blobs,
    and a build that silently ran local-only would look shared until the next machine rebuilt it.
    """
    url = environ.get(REMOTE_ENV, "").strip()
    blobs_url = environ.get(BLOBS_ENV, "").strip()
    if not url and blobs_url:
        raise InvalidRemote(f"{BLOBS_ENV}={redact(blobs_url)} is set without {REMOTE_ENV}: it holds the blobs of a "
                            f"tier whose records live elsewhere; set {REMOTE_ENV}=redis://HOST:PORT/DB beside it, "
                            f"or {REMOTE_ENV}={redact(blobs_url)} alone for object-store-only")
    if not url:
        return None
    problems = []
    backend = BACKENDS.get(urlsplit(url).scheme)
    if backend is None:
        nouns, examples = _expected(BACKENDS.values())
        problems.append(f"{REMOTE_ENV}={redact(url)} is not {nouns}; expected {examples}")
    blob_backend = BACKENDS.get(urlsplit(blobs_url).scheme) if blobs_url else None
    if blobs_url and (blob_backend is None or blob_backend.blobs is None):
        nouns, examples = _expected(b for b in BACKENDS.values() if b.blobs is not None)
        problems.append(f"{BLOBS_ENV}={redact(blobs_url)} is not {nouns}; expected {examples}")
        blob_backend = None
    mode = environ.get(MODE_ENV, "").strip() or "read-write"
    if mode not in MODES:
        problems.append(f"{MODE_ENV}={mode}: expected read-write or read-only")
    lease = _seconds(environ, LEASE_ENV, 60.0, problems)
    wait = _seconds(environ, WAIT_ENV, 3600.0, problems)
    for name, value, chosen in ((REMOTE_ENV, url, backend), (BLOBS_ENV, blobs_url, blob_backend)):
        if chosen is not None:
            try:
                chosen.check(value, name)
            except InvalidRemote as e:
                problems.append(str(e))
    if problems:
        raise InvalidRemote("; ".join(problems))
    secret = environ.get(KEY_ENV) or None
    settings = dict(secret=secret.encode() if secret else None, read_only=mode == "read-only",
                    lease_seconds=lease, wait_seconds=wait, warn=warn)
    blobs = blob_backend.blobs(blobs_url, settings, environ) if blob_backend is not None else None
    return backend.tier(url, settings, blobs, environ)

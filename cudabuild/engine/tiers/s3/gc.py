"""Bounding an S3 tier's blobs: what `cudabuild cache gc --remote --max-size SIZE [--keep-days N]`
does to the tier (the command, its arguments and its words are cudabuild.engine.cache_admin's).

Evicts least-recently-used blobs from the tier's object store (blobs.py) until the blobs
there take at most SIZE, and never one that a record younger than N days names, nor one used in the
last hour (a builder may have uploaded it and not yet published the record that names it).

- A blob's last use is the later of its own LastModified (its upload) and its `used/<sha>` marker's
  (rewritten by every read-write builder that downloads or uploads it): S3 keeps no access times.
- A record's age: in object-store-only mode, since its object was written; with records on Redis,
  since it was last read or written (Redis's OBJECT IDLETIME). A record left naming an evicted
  blob is harmless: builders treat it as a miss, rebuild, and publish it again.
- Redis-held blobs are not this module's business: Redis evicts them itself (maxmemory-policy).

It reads the tier through its own calls (records: Tier.young_records) and the bucket's objects.
Owns what an S3 tier's gc evicts. Must not touch: the local store, or anything above the tiers (it imports no cache_admin: the
arrow goes down, from the command to the tier).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

from cudabuild.errors import InvalidRemote

GRACE_SECONDS = 3600
DEFAULT_KEEP_DAYS = 7.0
DAY = 86400.0


@dataclass
class RemoteGcReport:
    where: str
    limit: int
    before: int = 0  # bytes of blobs before
    blobs: int = 0
    evicted: list[str] = field(default_factory=list)
    evicted_bytes: int = 0
    pinned: int = 0  # blobs a young record names
    recent: int = 0  # blobs used within the grace period
    dry_run: bool = False

    @property
    def after(self) -> int:
        return self.before - self.evicted_bytes


def _named(raws: list[bytes]) -> set[str]:
    shas = set()
    for raw in raws:
        try:
            outputs = json.loads(raw)["record"]["outputs"]
            shas.update(sha for sha in outputs.values() if isinstance(sha, str))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # unreadable: it pins nothing (builders ignore it too)
    return shas


def gc_remote(tier, max_bytes: int, keep_days: float = DEFAULT_KEEP_DAYS, now: Optional[float] = None,
              grace_s: float = GRACE_SECONDS, dry_run: bool = False) -> RemoteGcReport:
    blobs = getattr(tier, "blobs", None)
    if tier is None or blobs is None:
        raise InvalidRemote("cache gc --remote bounds an object store's blobs: set CUDABUILD_REMOTE_BLOBS=s3://BUCKET/PREFIX "
                            "(or CUDABUILD_REMOTE=s3://...); Redis evicts its own (maxmemory-policy allkeys-lru)")
    if not tier.writable:
        raise InvalidRemote(f"cache gc --remote deletes from {tier.where}; it cannot run with CUDABUILD_REMOTE_MODE=read-only")
    now = time.time() if now is None else now
    keep_s = keep_days * DAY
    raws = tier.young_records(keep_s, now)
    bucket = blobs.bucket
    listing = bucket.listing(bucket.key("blobs", ""), "blob listing")
    markers = bucket.listing(bucket.key("used", ""), "use listing")
    if raws is None or listing is None or markers is None:
        raise InvalidRemote(f"cache gc --remote could not list {tier.where} (see the warning above); nothing was evicted")
    pinned = _named(raws)
    used = {o["Key"].rsplit("/", 1)[-1]: o["LastModified"].timestamp() for o in markers}
    report = RemoteGcReport(tier.where, max_bytes, dry_run=dry_run)
    candidates = []
    for o in listing:
        sha, size = o["Key"].rsplit("/", 1)[-1], int(o["Size"])
        last = max(o["LastModified"].timestamp(), used.get(sha, 0.0))
        report.blobs += 1
        report.before += size
        if sha in pinned:
            report.pinned += 1
        elif now - last < grace_s:
            report.recent += 1
        else:
            candidates.append((last, sha, size))
    for _, sha, size in sorted(candidates):
        if report.after <= max_bytes:
            break
        if dry_run or bucket.delete(blobs.blob_key(sha), f"eviction of blob {sha[:12]}"):
            if not dry_run:
                bucket.delete(blobs.used_key(sha), f"eviction of blob {sha[:12]}")
            report.evicted.append(sha)
            report.evicted_bytes += size
    return report

"""The shared tiers behind every builder's local store: one interface, one module per backend.

- base.py: what every tier shares: the settings, records in signed envelopes, build leases,
  degrading when the server is down, the `Tier` interface, seeding a tier from a local store;
- factory.py: which tier the CUDABUILD_REMOTE* variables name (`from_env`), by the URL's scheme;
- redis.py: records, blobs and leases in Redis;
- s3/: an S3-compatible bucket: its client, blobs (also behind Redis), records and leases, gc.

A backend imports base.py only; the factory imports a backend when its scheme is configured. The
local store imports the factory only when $CUDABUILD_REMOTE is set. See docs/remote-cache.md.
"""

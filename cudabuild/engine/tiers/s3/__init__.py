"""The shared tier on an S3-compatible object store: client.py (the bucket, boto3, degrading),
blobs.py (content-addressed blobs, also behind a Redis tier), tier.py (object-store-only mode:
records and leases as objects too), gc.py (`cudabuild cache gc --remote`)."""

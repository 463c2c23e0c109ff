"""What every shared tier (Redis, an S3 bucket) keeps about itself, whatever server it talks to.

- `UNREACHABLE`: what a call returns when the server could not be asked (distinct from any reply);
- `Degrading`: a server found down is not asked again by this process, one that refused a write
  gets no more writes, and each kind of trouble is said once, not once per blob;
- `TierSettings`: how a tier is used (signing secret, read-only, lease and wait times) and its
  transfer counters, read by `cache stats` and the benchmarks.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from cudabuild.errors import one_line


class _Unreachable:
    def __repr__(self):
        return "UNREACHABLE"


UNREACHABLE = _Unreachable()


class Degrading:
    noun = "remote cache"  # how warnings name the server: "remote cache <where> ..."

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn
        self._state = threading.Lock()
        self._down = False
        self._writes_off = False
        self._warned: set[str] = set()

    def warn_once(self, topic: str, message: str) -> None:
        with self._state:
            if topic in self._warned:
                return
            self._warned.add(topic)
        self.warn(message)

    def refused(self, what: str, error: BaseException, *, write: bool) -> None:
        """The server answered no (a Redis out of memory, a 403): a refused write turns this
        process's writes off; a refused read is only said."""
        if write:
            self._writes_off = True
            self.warn_once("writes", f"{self.noun} {self.where} refused a write ({what}: {one_line(error)}); "
                                     "this build writes nothing more to it")
        else:
            self.warn_once("reads", f"{self.noun} {self.where} refused a read ({what}: {one_line(error)})")


class TierSettings:
    def __init__(self, *, secret: Optional[bytes], read_only: bool, lease_seconds: float, wait_seconds: float,
                 warn: Callable[[str], None]):
        self.secret = secret
        self.read_only = read_only
        self.lease_seconds = lease_seconds
        self.wait_seconds = wait_seconds
        self.warn = warn
        self.stats = {"records_in": 0, "records_out": 0, "blobs_in": 0, "blobs_out": 0, "bytes_in": 0, "bytes_out": 0}

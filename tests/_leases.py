"""The build-lease checks both shared tiers (Redis, an S3 bucket) must pass, in one place."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time

from conftest import REPO
from cudabuild.engine.tiers import base


@contextlib.contextmanager
def holder_process(code: str, first_line: str, env=None):
    """A process running `code` (it takes lease "K", prints `first_line`, then sleeps), yielded once
    it has printed that line; killed on the way out, whatever happened."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == first_line
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=10)


def assert_taken_over_when_the_holder_dies(tier, holder, *, wait: float, lapse_under: float, released=lambda: True):
    """Kill `holder` (a process that holds lease "K" on the same server as `tier`): the lease lapses
    within `lapse_under` seconds, a waiter takes it over, and leaving its block releases it."""
    holder.kill()
    holder.wait(timeout=10)
    died = time.monotonic()
    tier.wait_for_result("K", deadline=died + wait)
    lapsed = time.monotonic() - died
    lease = tier.try_lease("K")
    assert isinstance(lease, base.Lease) and lapsed < lapse_under
    with lease:
        assert tier.try_lease("K") is None
    assert released(), "released on exit"
    assert isinstance(tier.try_lease("K"), base.Lease)

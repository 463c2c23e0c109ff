"""The build-lease checks both shared tiers (Redis, an S3 bucket) must pass, in one place."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time

from conftest import REPO
from cudabuild.engine.tiers import base


# One line for a holder's code, after it made `tier` and before it takes the lease: each renewal by
# the lease's heartbeat prints `renewed held|lost <seconds since the lease was taken>`.
RENEWALS_REPORTED = (
    "import time as _t; _taken, _renew = _t.monotonic(), tier._renew_lease; "
    "tier._renew_lease = lambda lease: (lambda kept: (print('renewed', 'held' if kept and repr(kept) != 'UNREACHABLE' "
    "else 'lost', round(_t.monotonic() - _taken, 2), flush=True), kept)[1])(_renew(lease))"
)


@contextlib.contextmanager
def holder_process(code: str, first_line: str, env=None):
    """A process running `code` (it takes lease "K", prints `first_line`, then sleeps), yielded once
    it has printed that line; killed on the way out, whatever happened."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        line = holder.stdout.readline().strip()
        while line.startswith("renewed "):  # a renewal may come first on a busy machine
            line = holder.stdout.readline().strip()
        assert line == first_line
        yield holder
    finally:
        holder.kill()
        holder.wait(timeout=60)


def held_past_its_time(holder, lease_seconds: float) -> None:
    """Wait until the holder's heartbeat has renewed its lease more than twice the lease's time after
    taking it (RENEWALS_REPORTED), each renewal finding it still held: only the heartbeat kept it.
    Waits for what the holder reports, not for a time, so a busy machine makes it slower, not wrong."""
    while True:
        line = holder.stdout.readline().split()
        assert line and line[0] == "renewed", f"the holder stopped reporting renewals: {line}"
        assert line[1] == "held", f"a renewal found the lease lapsed, or the server gone: {line}"
        if float(line[2]) > 2 * lease_seconds:
            return


def assert_taken_over_when_the_holder_dies(tier, holder, *, wait: float = 600, released=lambda: True):
    """Kill `holder` (a process that holds lease "K" on the same server as `tier`): the lease lapses,
    a waiter takes it over, and leaving its block releases it. (`wait` bounds a lease that never
    lapses, which the take-over then fails on; how soon it lapses is not asserted: the server's
    expiry and the waiter's polls run late on a busy machine.)"""
    holder.kill()
    holder.wait(timeout=60)
    tier.wait_for_result("K", deadline=time.monotonic() + wait)
    lease = tier.try_lease("K")
    assert isinstance(lease, base.Lease)
    with lease:
        assert tier.try_lease("K") is None
    assert released(), "released on exit"
    assert isinstance(tier.try_lease("K"), base.Lease)

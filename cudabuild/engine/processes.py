"""Whether a process named by its pid still runs: the one answer for every record that names its
writer (a ledger's reservation, a killed stage's work folder, a warm server's entry)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether the process runs: signal 0 reaches it, and it is not a zombie its parent has yet to
    reap (a killed stage's process stays one until its worker waits for it; a server outlives the
    build that started it)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError:  # another user's (EPERM), or no /proc: alive as far as we can tell
        return True

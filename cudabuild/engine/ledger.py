"""A budget of bytes (host memory, a device's memory) that stages reserve from before they run,
shared by every process of the builds of one cache.

A stage asks for its need; it is let in when what the stages in already reserved, plus its
need, fits the budget, or when nobody is in (a need past the budget runs alone rather than
never). Waiters are served first come, first served, so a big stage is not passed by small ones
forever. This is what Bazel's local resource manager does for RAM and CPU: it admits by the
sum of the needs in flight, so two stages whose measured needs fit together never wait for
each other, where a rule of "N workers times one stage's need" would make them.

The ledger is one JSON file under the cache's locks folder, read and written under an flock:
`{"in": {token: {pid, bytes, stage}}, "waiting": [token, ...]}`. An entry whose process is gone
(killed, crashed) is dropped by the next reader, so a dead build never holds the budget.

Owns the file and the waiting. Must not touch: how a need or a budget is estimated
(cudabuild.engine.workers, cudabuild.engine.admission).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.engine import processes

POLL_S = 0.25


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict]:
    """The ledger's content for the block, written back after it, under its lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            state = {}
        if not isinstance(state, dict):
            state = {}
        state.setdefault("in", {})
        state.setdefault("waiting", [])
        state["in"] = {t: e for t, e in state["in"].items() if isinstance(e, dict) and processes.alive(int(e.get("pid", 0)))}
        state["waiting"] = [w for w in state["waiting"] if isinstance(w, list) and len(w) == 2 and processes.alive(int(w[1]))]
        yield state
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, path)


def held(path: Path) -> int:
    """The bytes reserved now by the stages that are in."""
    with _locked(path) as state:
        return sum(int(e["bytes"]) for e in state["in"].values())


@contextlib.contextmanager
def reserved(path: Path, need: Optional[int], budget: int, stage: str = "") -> Iterator[float]:
    """Hold `need` bytes of `budget` for the block (None: all of it, to run alone); yields the
    seconds waited for them."""
    token, pid = uuid.uuid4().hex, os.getpid()
    want = budget if need is None else max(0, int(need))
    start = time.monotonic()
    queued = False
    try:
        while True:
            with _locked(path) as state:
                if not queued:
                    state["waiting"].append([token, pid])
                    queued = True
                first = state["waiting"][0][0] == token if state["waiting"] else True
                taken = sum(int(e["bytes"]) for e in state["in"].values())
                if first and (not state["in"] or taken + want <= budget):
                    state["waiting"] = [w for w in state["waiting"] if w[0] != token]
                    state["in"][token] = {"pid": pid, "bytes": want, "stage": stage}
                    break
            time.sleep(POLL_S)
    except BaseException:  # interrupted while waiting: out of the queue, or the next in it waits forever
        with _locked(path) as state:
            state["waiting"] = [w for w in state["waiting"] if w[0] != token]
        raise
    try:
        yield time.monotonic() - start
    finally:
        with _locked(path) as state:
            state["in"].pop(token, None)
            state["waiting"] = [w for w in state["waiting"] if w[0] != token]

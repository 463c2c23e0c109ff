"""What earlier runs of a stage measured: how long it took (progress's "last run took") and its
rows in the store's build log (admission's last peak, cudabuild.engine.admission).

Owns reading those from a stage's stamp and the logged builds of the same model and target. Must
not touch: the stamps or the log themselves (runner.py and manifest.py write them).
"""

from __future__ import annotations

from typing import Iterator, Optional

from cudabuild.engine.graph import Stage

LOGGED_BUILDS = 50  # how far back the build log is read


def expected_seconds(build, stage: Stage) -> Optional[float]:
    """How long the stage's last run took: its stamp's, else the newest logged build of this
    model and target that ran it."""
    stamp = build.read_stamp(stage)
    seconds = stamp and (stamp.seconds if stamp.status == "ran" else stamp.saved_seconds)
    if seconds:
        return float(seconds)
    row = next((r for r in logged_rows(build, stage) if r.get("status") == "ran"), None)
    return (float(row.get("seconds") or 0.0) or None) if row else None


def logged_rows(build, stage: Stage) -> Iterator[dict]:
    """The stage's rows in the logged builds of this model and target, newest first."""
    config = build.config
    for entry in reversed(build.store.actions.build_log(last=LOGGED_BUILDS)):
        if (entry.get("model"), entry.get("target")) == (config.model, config.target):
            yield from (row for row in entry.get("stages", [])
                        if (row.get("stage"), row.get("method")) == (stage.kind, stage.method))

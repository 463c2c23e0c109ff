"""Pointing a built stage at its current key without running it.

For a change of inputs known not to change what the stage produces: `autotune=pin` names the
decisions the compile just made, and replaying them reproduces it (cudabuild/backend/tuning.py).
Owns that one move: a record under the new key with the stamp's outputs, and the stamp rewritten.
Must not touch: the decision (runner.py), or anything a stage produced.
"""

from __future__ import annotations

from cudabuild.engine.graph import Stage
from cudabuild.engine.hashing import digest


def rekey(runner, stage: Stage) -> bool:
    """Point the stage's stamp, and a record, at its current key. False if already so."""
    stamp = runner.stamps.require(stage)
    inputs = runner.inputs(stage)
    key = digest(inputs)
    if key == stamp.key:
        return False
    runner.store.actions.put_record(key, {"stage": stage.id, "digest": stamp.digest, "outputs": stamp.outputs,
                                  "finals": stamp.finals, "value": stamp.value, "seconds": stamp.seconds})
    runner.stamps.write(stage, stamp.replace(key=key, inputs=inputs))
    return True

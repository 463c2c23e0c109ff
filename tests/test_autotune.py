"""Autotuning decisions: harvested from a compile, replayed by a later compile with the same tuning
inputs (no benchmarking), and pinned in the repository with `autotune=pin`."""

from __future__ import annotations

import json

import pytest

from conftest import assert_ok

pytestmark = pytest.mark.slow

# max_autotune on the CPU tunes GEMMs between ATen and C++ templates; decode has static shapes,
# so inductor persists its choices (it does not for prefill's symbolic shapes).
TUNED = ("model=tiny_lm", "target=cpu", "decode.max_autotune=ON")


def compile_value(project, method="decode"):
    stamp = project.root / "build" / "tiny_lm" / "cpu" / ".stamps" / f"compile.{method}.json"
    return json.loads(stamp.read_text())["value"]


def compile_log(project) -> str:
    """What compile.decode's last run printed (cudabuild.engine.console.terminal sends it to the stage's log)."""
    return (project.build_dir / "logs" / "compile.decode.log").read_text()


def test_tune_pin_replay_without_benchmarking(tiny_copy):
    first = tiny_copy.export(*TUNED, "autotune=pin")
    assert_ok(first)
    assert "AUTOTUNE" in compile_log(tiny_copy)  # it really benchmarked (inductor's tables go to the stage's log)
    assert compile_value(tiny_copy)["autotune"] == "tuned" and compile_value(tiny_copy)["decisions"] > 0
    pins = json.loads((tiny_copy.root / "recipes" / "tiny_lm.autotune.json").read_text())
    assert pins["cpu"]["decode"]["files"], pins

    # Pinning re-keyed the compile: the same command again is a no-op.
    assert_ok(tiny_copy.export(*TUNED))
    assert set(tiny_copy.statuses().values()) == {"cached"}

    # A spec that changes the kernels but not what is tuned: compile reruns, replaying the pin.
    again = tiny_copy.export(*TUNED, "decode.emulate_precision_casts=OFF")
    assert_ok(again)
    assert tiny_copy.statuses()["compile.decode"] == "ran"
    assert compile_value(tiny_copy)["autotune"] == "pinned"
    assert "AUTOTUNE" not in compile_log(tiny_copy)

    # Without the pin (a key not built before), the decisions come back from the store instead.
    (tiny_copy.root / "recipes" / "tiny_lm.autotune.json").unlink()
    replay = tiny_copy.export(*TUNED, "decode.emulate_precision_casts=OFF")
    assert_ok(replay)
    assert tiny_copy.statuses()["compile.decode"] == "ran"
    assert compile_value(tiny_copy)["autotune"] == "replayed"
    assert "AUTOTUNE" not in compile_log(tiny_copy)

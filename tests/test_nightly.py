"""`doit nightly` (doit_tasks.DoitRun.task_nightly, cudabuild.engine.nightly): many builds in parallel worker
processes, one broken model that stops nobody, and build/nightly.json."""

from __future__ import annotations

import json

import pytest

BROKEN_RECIPE = '''"""broken: a recipe whose model cannot be built."""
from cudabuild.recipe import Method, Recipe


def build(options):
    raise RuntimeError("this model is broken on purpose")


RECIPE = Recipe(build=build, methods=(Method("forward", inputs=lambda model: ()),))
'''


@pytest.mark.slow
def test_a_broken_model_does_not_stop_the_others(built_tiny, tmp_path):
    proj = built_tiny.copy(tmp_path)
    (proj.root / "recipes" / "broken.py").write_text(BROKEN_RECIPE)
    result = proj.doit("-n", "2", "nightly", "models=tiny_lm,broken", "targets=cpu")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((proj.root / "build" / "nightly.json").read_text())
    builds = {b["model"]: b for b in report["builds"]}
    assert builds["tiny_lm"]["status"] == "ok" and builds["tiny_lm"]["stages"]["cached"] == 14
    assert builds["tiny_lm"]["outputs"] == built_tiny.manifest()["outputs"]
    broken = builds["broken"]
    assert broken["status"] == "failed" and broken["failed_step"] == "trace.forward"
    assert "broken on purpose" in broken["error"] and "compile.forward" in broken["skipped"]
    assert (report["ok"], report["failed"], report["cache"]["hit_rate"]) == (1, 1, 1.0)
    assert "1 of 2 nightly builds failed (broken/cpu)" in result.stdout + result.stderr
    assert not (proj.root / "build" / ".nightly").exists()  # the run's journal is cleaned up
    assert not (proj.root / "build" / "broken" / "cpu" / "manifest.json").exists()

"""A build's manifest.json: each stage's key, status, seconds and why, the outputs' hashes, verify's
numbers; written once every stage succeeded, with the build logged in the store.

Owns what the manifest says and writing it. It reads the stamps and this process's statuses (a
runner's); it decides and runs nothing. Must not touch: the stamps themselves, or the store's
records (rekey.py points a built stage at a new key).
"""

from __future__ import annotations

import json

from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.graph import Stage


def manifest(runner) -> dict:
    config = runner.config
    stages = []
    outputs = {}
    verify = {}
    for stage in runner.pipeline.plan(config):
        stamp = runner.read_stamp(stage)
        this_run = stamp is not None and stamp.run == runner.run_id
        # What this process did, not what the stamp says now: another build of the same project
        # may have rewritten the stamp since (its restore of what we ran), which made a stage
        # this build compiled read as "cached" and the other's "restored": no "ran" at all.
        # Under `doit -n` stages run in worker processes: their statuses reach us only through
        # the stamps they wrote with this run's id.
        status = runner.statuses.get(stage.id) or (stamp.status if this_run else None) or "cached"
        entry = {"stage": stage.kind, "method": stage.method, "key": stamp.key if stamp else None,
                 "status": status, "seconds": stamp.seconds if this_run else 0.0}
        if this_run and stamp.reason:
            entry["reason"] = stamp.reason
        if this_run and stamp.peak_rss:
            entry["peak_rss"] = stamp.peak_rss  # bytes resident at the stage's peak (sampled)
        if this_run and stamp.worker:
            entry["worker"] = stamp.worker  # the cluster's worker it ran on (cudabuild.engine.cluster)
        if this_run and isinstance(stamp.value, dict) and stamp.value.get("note"):
            entry["note"] = stamp.value["note"]  # what the stage says it did (the blob stage: rewritten)
        if status in ("restored", "remote", "cached"):
            entry["saved_seconds"] = stamp.cost_seconds if stamp else 0.0
        stages.append(entry)
        if stamp is None:
            continue
        for name in stamp.finals:
            outputs[name] = stamp.outputs[name]
        if stage.kind == "verify" and stamp.value:  # the manifest's verify section: each method's numbers
            verify[stage.method] = stamp.value
    probe = runner.read_stamp(Stage("probe"))
    return {"model": config.model, "target": config.target, "options": dict(config.options),
            "specs": {m: dict(s) for m, s in config.specs.items()}, "toolchain": probe.value if probe else None,
            "stages": stages, "outputs": dict(sorted(outputs.items())), "verify": verify}


def not_in_cache(store, stages) -> list[str]:
    """Of the manifest's stages, those up to date in build/ (cached) whose record the cache lacks:
    an emptied cache, or another CUDABUILD_CACHE_DIR than the one that built build/. Such a build
    restored nothing and the cache saved it nothing; a change rebuilds those stages from scratch."""
    return [f"{s['stage']}.{s['method']}" if s["method"] else s["stage"] for s in stages
            if s["status"] == "cached" and s.get("key") and store.actions.lookup(s["key"])[0] is None]


def write(runner) -> dict:
    """After every stage succeeded: manifest.json, the build log, and no stale failure reports."""
    data = manifest(runner)
    build_dir = runner.config.build_dir
    atomic_write_text(build_dir / "manifest.json", json.dumps(data, indent=1, sort_keys=False))
    for method in data["verify"]:  # each verified now: an earlier failure's report is history
        (build_dir / f"verify-{method}.failed.json").unlink(missing_ok=True)
    runner.store.actions.record_build(data)
    return data

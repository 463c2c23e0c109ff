"""The nightly build's bookkeeping: a journal of what each stage did, and build/nightly.json.

    doit -n 4 nightly                                  # every recipe, target=auto
    doit -n 4 nightly models=tiny_lm,qwen_moe targets=cpu,cuda

doit_tasks.task_nightly turns every (model, target) build into the same stage sub-tasks as
`doit export`, with each action wrapped by `contained`: a stage that fails is journalled, the rest
of its build is skipped, and doit sees a success, so one model's failure never stops the others
(doit's --continue would not do: the report task, which depends on every build, would be skipped).
The journal lives in build/.nightly/<run id>/, one small JSON file per finished stage, because
`doit -n` runs stages in separate worker processes. The last sub-task reads it, writes
build/nightly.json (per build: status, times, cache statistics; totals; the remote tier's numbers)
and fails the run when any build failed. Nothing here imports torch. On a cluster
(cudabuild.engine.cluster) each build also says where each stage ran (`placement`) and which
were retried after their worker died (`retried`), and nightly.json says what was sent (`cluster`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

from doit.exceptions import TaskFailed

from cudabuild.errors import one_line
from cudabuild.engine.files import atomic_write_text

STATUSES = ("ran", "restored", "remote", "cached")


class Journal:
    """One run's record of finished stages, shared by doit's worker processes through files."""

    def __init__(self, project: Path, run_id: str):
        self.dir = Path(project) / "build" / ".nightly" / run_id

    def write(self, build: str, step: str, entry: dict) -> None:
        path = self.dir / f"{build.replace('/', '~')}~{step}.json"
        atomic_write_text(path, json.dumps(dict(entry, build=build, step=step), sort_keys=True))

    def entries(self, build: Optional[str] = None) -> list[dict]:
        pattern = f"{build.replace('/', '~')}~*.json" if build else "*.json"
        found = []
        for path in sorted(self.dir.glob(pattern)):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found

    def failure(self, build: str) -> Optional[dict]:
        return next((e for e in self.entries(build) if e["status"] == "failed"), None)

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.parent.rmdir()  # build/.nightly, when no other run is using it
        except OSError:
            pass


def contained(journal: Journal, build: str, step: str, action: Callable, status: Callable[[], str]) -> Callable:
    """`action` (a doit python-action) made safe for one build among many: skipped once its build
    has failed; a failure or an exception is journalled and printed, never raised to doit."""

    def run():
        if failed := journal.failure(build):
            journal.write(build, step, {"status": "skipped", "after": failed["step"]})
            return True
        started = time.time()
        try:
            result = action()
            error = result.message.strip() if isinstance(result, TaskFailed) else None
        except Exception as e:  # a bug in one build's stage must not stop the other builds
            if os.environ.get("CUDABUILD_VERBOSE"):
                raise
            error = one_line(e)
        entry = {"started": started, "finished": time.time()}
        if error:
            print(f"cudabuild: error: [{build} {step}] {error}", file=sys.stderr, flush=True)
            entry.update(status="failed", error=error.splitlines()[0])  # the log's path and tail stay on the console
        else:
            entry.update(status=status())
        journal.write(build, step, entry)
        return True

    return run


def summarise(build: str, entries: list[dict], manifest: Optional[dict], load_error: Optional[str] = None) -> dict:
    """One build's line in nightly.json."""
    model, target = build.split("/", 1)
    failed = next((e for e in entries if e["status"] == "failed"), None)
    times = [e for e in entries if "started" in e]
    summary = {
        "model": model, "target": target,
        "status": "failed" if failed or load_error else "ok",
        "wall_seconds": round(max(e["finished"] for e in times) - min(e["started"] for e in times), 3) if times else 0.0,
    }
    if load_error:
        summary.update(failed_step="load", error=load_error)
    elif failed:
        summary.update(failed_step=failed["step"], error=failed["error"],
                       skipped=sorted(e["step"] for e in entries if e["status"] == "skipped"))
    if manifest and not failed and not load_error:
        rows = manifest["stages"]
        summary["stages"] = {s: sum(1 for r in rows if r["status"] == s) for s in STATUSES}
        summary["run_seconds"] = round(sum(r["seconds"] for r in rows), 3)
        summary["saved_seconds"] = round(sum(r.get("saved_seconds") or 0.0 for r in rows if r["status"] != "ran"), 3)
        summary["outputs"] = manifest["outputs"]
        placed = {_stage_id(r): r["worker"] for r in rows if r.get("worker")}
        if placed:  # stage -> the cluster's worker it ran on: host, pid, GPU, address
            summary["placement"] = {s: {k: w.get(k) for k in ("name", "host", "pid", "gpu", "address")}
                                    for s, w in placed.items()}
            summary["retried"] = {s: w["lost"] for s, w in placed.items() if w.get("lost")}
    return summary


def _stage_id(row: dict) -> str:
    return f"{row['stage']}.{row['method']}" if row.get("method") else row["stage"]


def report(builds: list[dict], started: float, remote: Optional[dict], cluster: Optional[dict] = None) -> dict:
    """nightly.json: the builds, totals over them, the remote tier's own numbers (or None), and on
    a cluster where it was, its workers, how many tasks were sent and which were retried."""
    counts = Counter()
    for b in builds:
        counts.update(b.get("stages", {}))
    total = sum(counts.values())
    served = total - counts["ran"]
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 3),
        "builds": builds,
        "ok": sum(1 for b in builds if b["status"] == "ok"),
        "failed": sum(1 for b in builds if b["status"] != "ok"),
        "cache": {
            "stages": {s: counts[s] for s in STATUSES},
            "hit_rate": round(served / total, 3) if total else None,
            "saved_seconds": round(sum(b.get("saved_seconds", 0.0) for b in builds), 3),
        },
        "remote": remote,
        **({"cluster": cluster} if cluster is not None else {}),
    }


def print_report(data: dict, out=None) -> None:
    out = out or sys.stdout
    out.write(f"\nnightly: {data['ok']} ok, {data['failed']} failed, {data['seconds']:.1f}s\n")
    out.write(f"  {'model':<14}{'target':<8}{'status':<8}{'seconds':>9}  stages\n")
    for b in data["builds"]:
        detail = (", ".join(f"{s} {n}" for s, n in b["stages"].items() if n) if "stages" in b
                  else f"{b.get('failed_step')}: {b.get('error')}")
        out.write(f"  {b['model']:<14}{b['target']:<8}{b['status']:<8}{b['wall_seconds']:>9.1f}  {detail}\n")
    cache = data["cache"]
    rate = "n/a" if cache["hit_rate"] is None else f"{cache['hit_rate']:.0%}"
    out.write(f"  cache: hit rate {rate}, {cache['saved_seconds']:.1f}s saved\n")
    if "cluster" in data:
        c = data["cluster"]
        retried = f", {len(c['retried'])} retried after a worker died" if c["retried"] else ""
        workers = f"{len(c['workers'])} workers" if c["workers"] else "not started (nothing to run)"
        out.write(f"  cluster {c['address']}: {workers}, {c['submitted']} stages sent{retried}\n")
    out.flush()


"""What the benchmarks share: a throwaway copy of the project, a time budget, whole-process builds
with their logs kept, and the warm processes they start stopped at the end.

    from _harness import Bench, arguments
    args = arguments(__doc__, layers=8, budget=1500)          # --out, --budget, --layers, and the script's own
    bench = Bench(args.out, args.budget)
    project, cache = bench.project("cold"), bench.work / "cache-cold"
    entry = bench.build("cold", project, cache, "size=35b-a3b", f"layers={args.layers}")
    bench.write("my_bench.json", result)                      # results beside the logs' tarball

A case is one whole `doit export` process (or a script), timed from outside, in a project copied
from this checkout (dodo.py, cudabuild/, recipes/, bench/) with a cache of its own, so a bench
never touches the checkout's build/ or the user's cache. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_FOLDERS = ("cudabuild", "recipes", "bench")


def arguments(doc: str, *, layers: int | None = None, budget: float = 560, argv=None, extra=()) -> argparse.Namespace:
    """The options every GPU bench takes: --out (default $OUT or .), --budget seconds, and --layers
    where the bench builds the real shapes; `extra`: (flags, keyword arguments) of its own."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where the results and logs go")
    parser.add_argument("--budget", type=float, default=budget, help="seconds; cases that would not fit are skipped")
    if layers is not None:
        parser.add_argument("--layers", type=int, default=layers, help="size=35b-a3b cut to this many layers (0: all 40)")
    for flags, kwargs in extra:
        parser.add_argument(*flags, **kwargs)
    args = parser.parse_args(argv)
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def copy_project(root: Path) -> Path:
    """A throwaway copy of this checkout's project at `root` (made once)."""
    if not root.exists():
        root.mkdir(parents=True)
        shutil.copy(ROOT / "dodo.py", root)
        for folder in PROJECT_FOLDERS:
            shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def du(path: Path) -> int:
    """The bytes of the files under `path` (links not followed)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def stop_warm_processes(work: Path) -> int:
    """Stop the warm processes of the caches under `work`: each would otherwise stay up, idle, for
    15 minutes with about 450 MB resident. How many were stopped."""
    sys.path.insert(0, str(ROOT))
    from cudabuild.engine import warm  # no torch: the process list only

    mine = [p for p in warm.running() if p.get("cache", "").startswith(str(work.resolve()))]
    for process in mine:
        warm.stop(process)
    warm.wait_gone(mine, 15.0)
    return len(mine)


class Bench:
    """One run of a bench: its work folder (projects, caches), its budget, its logs, its results.

    `model` and `target` name the build whose stamps, logs and trace `build` collects; `name` the
    JSON file `save` writes the results to, beside logs.tar.gz."""

    def __init__(self, out: Path, budget: float, model: str = "qwen_moe", target: str = "cuda", name: str = "qwen_moe_cuda"):
        self.out, self.budget, self.start = Path(out), budget, time.monotonic()
        self.model, self.target, self.name = model, target, name
        self.work = Path(tempfile.mkdtemp(prefix=f"{name.replace('_', '-')}-bench-"))
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.results: dict = {"cases": {}}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def fits(self, case: str, estimate: float) -> bool:
        """Whether a case of `estimate` seconds fits the budget left; one that does not is recorded as skipped."""
        if estimate <= self.left():
            return True
        self.results["cases"][case] = {"skipped": f"time budget ({self.left():.0f} s left)"}
        print(f"{case:<24} skipped (budget)", flush=True)
        return False

    def write(self, name: str, data: dict) -> None:
        (self.out / name).write_text(json.dumps(data, indent=1, default=str))

    def save(self) -> None:
        self.write(f"{self.name}.json", self.results)
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")

    def finish(self, keep: bool = False) -> None:
        """Save, stop the warm processes the cases started, and (unless `keep`) free the work folder's disk."""
        self.save()
        stop_warm_processes(self.work)
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)

    def project(self, name: str) -> Path:
        return copy_project(self.work / name)

    def run(self, name: str, cmd: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None) -> dict:
        """One whole process, timed; its output, and the logs, trace and manifest its build wrote now, kept."""
        env = dict(os.environ, **(env or {}))
        t0, wall = time.monotonic(), time.time()
        try:
            done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout or max(self.left(), 30))
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", _text(e.stdout), _text(e.stderr)
        entry = {"seconds": round(time.monotonic() - t0, 2), "rc": rc}
        (self.logs / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{stdout[-40000:]}\n--- stderr ---\n{stderr[-40000:]}")
        build = cwd / "build" / self.model / self.target
        for log in (build / "logs").glob("*.log") if build.exists() else []:
            if log.stat().st_mtime >= wall:
                (self.logs / name).mkdir(exist_ok=True)
                shutil.copy(log, self.logs / name / log.name)
        for extra in ("trace.json", "manifest.json"):
            if (build / extra).exists() and (build / extra).stat().st_mtime >= wall:
                shutil.copy(build / extra, self.logs / f"{name}-{extra}")
        for failed in build.glob("verify-*.failed.json") if build.exists() else []:
            if failed.stat().st_mtime >= wall:
                entry.setdefault("verify_failed", {})[failed.name] = json.loads(failed.read_text())
        entry["stdout_tail"], entry["stderr_tail"] = stdout[-1500:], stderr[-1500:]
        print(f"{name:<24}{entry['seconds']:8.1f}s rc={rc}", flush=True)
        return entry

    def build(self, name: str, project: Path, cache: Path, *settings: str, tasks=("export",), env=None) -> dict:
        """`doit TASKS model=... target=... SETTINGS` in `project` with `cache`: run(), plus each stage's
        stamp and, where this build wrote one, the manifest's statuses, verify and outputs."""
        cmd = [sys.executable, "-m", "doit", *tasks, f"model={self.model}", f"target={self.target}", *settings]
        env = {"CUDABUILD_CACHE_DIR": str(cache), "CUDABUILD_PROJECT": str(project),
               "PYTHONPATH": f"{project}:{os.environ.get('PYTHONPATH', '')}", **(env or {})}
        entry = self.run(name, cmd, project, env)
        build = project / "build" / self.model / self.target
        stamps = {p.stem: json.loads(p.read_text()) for p in (build / ".stamps").glob("*.json")} if build.exists() else {}
        entry["stages"] = {stage: {"status": s.get("status"), "seconds": s.get("seconds"), "run": s.get("run"),
                                   "value": _small(s.get("value"))} for stage, s in sorted(stamps.items())}
        manifest = build / "manifest.json"
        if manifest.exists() and manifest.stat().st_mtime >= time.time() - entry["seconds"] - 1:
            data = json.loads(manifest.read_text())
            entry["statuses"] = {f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]: s["status"] for s in data["stages"]}
            entry["verify"] = data.get("verify")
            entry["outputs"] = data.get("outputs")
        return entry


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _small(value):
    if isinstance(value, dict):
        return {k: _small(v) for k, v in value.items() if k not in ("fallback_kernels",)}
    return value

"""The CUDA target on a GPU machine, every case side by side in one run (issue: CUDA target).

    python bench/cuda_target.py [--model tiny_lm] [--set size=35b-a3b --set layers=4] [--budget 280] [--out DIR]
    python bench/cuda_target.py --target cpu --cases cold,noop,replay,method,cold2,warm,pinned,stock,stockwarm   # on a CPU

Cases, each a whole `doit export ... target=cuda` process with its own cache dir:
  cold        empty cache, the recipe's specs, the default workers (three on cuda); then
              bench/package_identity.py: are the stand-in package's bytes those of lowering the
              exported programs?
  cold1       the same build with one worker (CUDABUILD_JOBS=1), in a fresh cache dir
  cold2w      the same with two workers (CUDABUILD_JOBS=2)
  cold4w      the same with four workers (CUDABUILD_JOBS=4)
  noop        the same again
  replay      a spec change that keeps tuning inputs (emulate_precision_casts=OFF): compile reruns,
              autotuning decisions are replayed, not re-benchmarked; the casts change the Triton
              kernels' sources, so some kernels compile again
  keepkernels a spec change that keeps every kernel's source (compile_wrapper_opt_level flipped
              between O0 and O1: the wrapper's C++ flags only): compile reruns, every Triton kernel
              comes from the kernel cache and every tuning decision is replayed
  second      a second machine: a fresh project whose cache is a copy of cold's, taken right after
              cold (what a shared tier holds once cold wrote it back), building keepkernels' spec.
              The tier's transfer time is not in it: bench/remote.py measures restores over Redis
              and an object store
  layer       an edit of the model's code that changes its last layer's kernels (tiny_lm: the last
              layer's output scaled by 1.0001), on copies of the project and cache taken right
              after cold: export reruns, and compile finds the other kernels in the kernel cache
  edit        the same edit in the main project, with its cache and its warm process (the everyday
              case: a developer edits the model and re-exports); the edit is undone afterwards
  workers2    replay's spec change with two workers (CUDABUILD_JOBS=2), on a copy of the project
              and cache taken right after cold: both compiles share the GPU once cold measured
              their device memory, kernel timings one at a time; its time against replay's
  method      a one-method spec change (decode.low_memory_mode flipped): only decode's compile,
              the package and decode's verify rerun
  lowmem      low_memory_mode=ON (peak GPU memory during compile vs cold's)
  cold2       a second cold build in a fresh cache dir: are .pte/.ptd byte-identical to cold's?
  warm        a cold build in a fresh cache dir whose kernel cache is cold's (a second machine whose
              shared tier served every compiled Triton kernel): its time against cold's, and are
              .pte/.ptd byte-identical to cold's?
  pinned      tuning pinned from the main build (`autotune=pin`), then a cold build in a fresh cache
              and a build whose kernel cache is that one's, both with those pins: with no timing
              left to choose, are their .pte/.ptd byte-identical?
  o0          a cold build in a fresh cache with compile_wrapper_opt_level=O0 (the wrapper's C++ at
              -O0, as ExecuTorch's Qwen3.5-MoE exporter builds it; unset is inductor's -O1): its compile
              stages' seconds against cold's
  stock       bench/baseline_lower.py: ExecuTorch's own CudaPartitioner, same specs, no cache,
              inductor's caches empty
  stockwarm   the same again, inductor's caches warm (what a re-export costs today)
Cases are skipped once the time budget would be exceeded. Results are printed and written to
OUT/cuda_target.json; each case's timeline (OUT/<case>-trace.json) and the logs of the stages it
ran (OUT/logs-<case>/) come back beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Bench, arguments, stop_warm_processes  # noqa: E402

COLD_WITH_JOBS = {"cold1": "1", "cold2w": "2", "cold4w": "4"}  # case -> CUDABUILD_JOBS of a cold build in a fresh cache
ESTIMATE = {"keepkernels": 60, "second": 60, "layer": 70, "edit": 50, "cold": 130, "cold1": 140, "cold2w": 130, "cold4w": 130, "noop": 5, "replay": 80, "workers2": 60, "method": 70, "lowmem": 110, "cold2": 130, "warm": 100, "pinned": 300, "o0": 120, "stock": 100,
            "stockwarm": 60}  # H200, tiny_lm


def sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def specs_of(project: Path, method: str) -> dict:
    """The specs the last build of `project` used for `method` (from its compile stamp)."""
    stamps = sorted(project.glob(f"build/*/*/.stamps/compile.{method}.json"))
    return json.loads(stamps[0].read_text())["inputs"].get("specs", {}) if stamps else {}


# The `layer` case's edit, by model: (file, text, replacement). A residual scale after the last
# layer only: one layer's kernels change, the rest keep their sources.
LAYER_EDITS = {
    "tiny_lm": ("cudabuild/models/tiny_lm.py",
                "        for layer in self.layers:\n            x = layer(x, input_pos, mask)\n",
                "        for index, layer in enumerate(self.layers):\n            x = layer(x, input_pos, mask)\n"
                "            if index == len(self.layers) - 1:\n                x = x * 1.0001\n"),
}
SNAPSHOT_CASES = ("workers2", "second", "layer")  # cases that start from copies taken right after cold


def flipped_opt_level(project: Path) -> str:
    """keepkernels' spec: the wrapper's other C++ optimization level than the last build's."""
    return "O1" if specs_of(project, "decode").get("compile_wrapper_opt_level") == "O0" else "O0"


def compile_spans(trace: Path) -> dict:
    """Per compile stage of a timeline: seconds, the share inductor's phases name, the kernels."""
    from cudabuild.backend.inductor_phases import ENCLOSING, named_share

    events = json.loads(trace.read_text())["traceEvents"]
    found = {}
    for stage in events:
        if stage.get("cat") == "stage" and stage["name"].startswith("compile.") and stage["args"].get("step") == "execute":
            inside = [e for e in events if e.get("pid") == stage["pid"] and stage["ts"] <= e["ts"] <= stage["ts"] + stage["dur"]]
            phases: dict[str, float] = {}
            for e in inside:
                if e.get("cat") in ("inductor", "tool") and e["name"] not in ENCLOSING:
                    phases[e["name"]] = round(phases.get(e["name"], 0.0) + e["dur"] / 1e6, 2)
            tools: dict[str, list] = {}  # program -> [runs, seconds]: what the C++ compile spent outside the compiler's own timer
            for e in inside:
                if e.get("cat") == "tool":
                    runs = tools.setdefault(e["name"].removeprefix("tool "), [0, 0.0])
                    runs[0], runs[1] = runs[0] + 1, round(runs[1] + e["dur"] / 1e6, 2)
            aoti = next((e["args"] for e in inside if e["name"] == "AOTInductor"), {})
            found[stage["name"]] = {"seconds": round(stage["dur"] / 1e6, 1), "named": round(named_share(events, stage), 3),
                                    "kernels": {k: v for k, v in aoti.items() if k.startswith("triton")},
                                    "top": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:8]), "tools": tools}
    return found


def compile_overlap(trace: Path) -> float | None:
    """Seconds during which the timeline's two compile stages ran at once."""
    if not trace.exists():
        return None
    events = json.loads(trace.read_text())["traceEvents"]
    runs = [e for e in events if e.get("cat") == "stage" and e["name"].startswith("compile.") and e["args"].get("step") == "execute"]
    if len(runs) != 2:
        return None
    a, b = runs
    return round(max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"])) / 1e6, 1)


def main() -> None:
    args = arguments(__doc__, budget=280, extra=(
        (("--model",), {"default": "tiny_lm"}),
        (("--cases",), {"default": "cold,noop,replay,method,lowmem,cold2,stock,stockwarm"}),
        (("--target",), {"default": "cuda", "choices": ("cuda", "cpu")}),
        (("--set",), {"action": "append", "default": [], "metavar": "NAME=VALUE",
                      "help": "recipe option or spec passed to every cudabuild build (e.g. size=35b-a3b)"})))
    bench = Bench(args.out, args.budget, model=args.model, target=args.target, name="cuda_target")
    work, out, results = bench.work, args.out, bench.results
    results["model"] = args.model

    def save():
        bench.write("cuda_target.json", results)

    def project(name: str) -> Path:
        return bench.project(name)

    def run(name: str, cwd: Path, cmd: list[str], cache: Path, extra_env: dict | None = None) -> dict:
        env = dict(os.environ, CUDABUILD_CACHE_DIR=str(cache), CUDABUILD_PROJECT=str(cwd), PYTHONPATH=f"{cwd}:{os.environ.get('PYTHONPATH', '')}")
        env.pop("CUDABUILD_KERNEL_CACHE", None)  # each cache's own kernel folder, unless a case shares one
        env.update(extra_env or {})
        for stale in (cwd / "build" / args.model / args.target).glob("verify-*.failed.json"):
            stale.unlink()  # an earlier case's: only this run's failures are reported for it
        t0, t0_wall = time.monotonic(), time.time()
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        entry = {"seconds": round(time.monotonic() - t0, 2), "rc": done.returncode}
        (out / f"{name}.log").write_text(done.stdout[-20000:] + "\n--- stderr ---\n" + done.stderr[-20000:])
        trace = cwd / "build" / args.model / args.target / "trace.json"
        if trace.exists() and trace.stat().st_mtime >= t0_wall:  # this case's timeline (Perfetto opens it)
            shutil.copy(trace, out / f"{name}-trace.json")
            entry["compile_spans"] = compile_spans(trace)
        for log in (cwd / "build" / args.model / args.target / "logs").glob("*.log"):
            if log.stat().st_mtime >= t0_wall:  # the stages this case ran: third-party output, AUTOTUNE tables
                (out / f"logs-{name}").mkdir(exist_ok=True)
                shutil.copy(log, out / f"logs-{name}" / log.name)
        for failed in (cwd / "build" / args.model / args.target).glob("verify-*.failed.json"):
            shutil.copy(failed, out / f"{name}-{failed.name}")  # where a mismatch arose, with its numbers
            entry.setdefault("verify_failed", {})[failed.name] = json.loads(failed.read_text()).get("fault")
        manifest_path = cwd / "build" / args.model / args.target / "manifest.json"
        if manifest_path.exists() and cmd[1:3] == ["-m", "doit"]:  # a cudabuild build, not a script
            manifest = json.loads(manifest_path.read_text())
            entry["statuses"] = {f"{s['stage']}.{s['method']}" if s["method"] else s["stage"]: s["status"] for s in manifest["stages"]}
            entry["verify"] = manifest.get("verify")
            entry["outputs"] = manifest.get("outputs")
            stamps = cwd / "build" / args.model / args.target / ".stamps"
            entry["compile"] = {p.stem: json.loads(p.read_text()).get("value") for p in stamps.glob("compile.*.json")}
        results["cases"][name] = entry
        save()
        ran = sorted(stage for stage, status in (entry.get("statuses") or {}).items() if status == "ran")
        print(f"{name:<8}{entry['seconds']:8.1f}s rc={entry['rc']}" + (f"  ran: {', '.join(ran)}" if "statuses" in entry else ""), flush=True)
        return entry

    doit = [sys.executable, "-m", "doit", "export", f"model={args.model}", f"target={args.target}", *args.set]
    main_project = project("main")
    cache = work / "cache-main"
    for case in args.cases.split(","):
        if not bench.fits(case, ESTIMATE[case]):
            continue
        if case == "cold":
            entry = run(case, main_project, doit, cache)
            entry["compile_overlap_seconds"] = compile_overlap(out / f"{case}-trace.json")
            if entry["rc"] == 0:
                for later in SNAPSHOT_CASES:  # the state those cases start from
                    if later in args.cases.split(","):
                        shutil.copytree(main_project, work / later, symlinks=True)
                        shutil.copytree(cache, work / f"cache-{later}", symlinks=True)
                # package lowers stand-ins: are its bytes those of lowering the exported programs?
                check = run("package_identity", main_project, [sys.executable, "bench/package_identity.py", args.model, args.target], cache)
                lines = (out / "package_identity.log").read_text().split("\n--- stderr ---")[0].strip().splitlines()
                results["package_identity"] = json.loads(lines[-1]) if check["rc"] in (0, 1) and lines else None
        elif case in COLD_WITH_JOBS:
            entry = run(case, project(case), doit, work / f"cache-{case}", {"CUDABUILD_JOBS": COLD_WITH_JOBS[case]})
            entry["compile_overlap_seconds"] = compile_overlap(out / f"{case}-trace.json")
        elif case == "noop":
            run(case, main_project, doit, cache)
        elif case == "replay":
            run(case, main_project, doit + ["emulate_precision_casts=OFF"], cache)
        elif case == "workers2" and (work / "workers2").exists():
            entry = run(case, work / "workers2", doit + ["emulate_precision_casts=OFF"], work / "cache-workers2",
                        {"CUDABUILD_JOBS": "2"})
            entry["compile_overlap_seconds"] = compile_overlap(out / f"{case}-trace.json")
        elif case == "keepkernels":
            run(case, main_project, doit + [f"compile_wrapper_opt_level={flipped_opt_level(main_project)}"], cache)
        elif case == "second" and (work / "second").exists():
            level = flipped_opt_level(work / "second")  # read from cold's stamps, before they go
            # A fresh checkout on the second machine: the project's files, none of its build outputs.
            shutil.rmtree(work / "second" / "build", ignore_errors=True)
            run(case, work / "second", doit + [f"compile_wrapper_opt_level={level}"], work / "cache-second")
        elif case == "layer" and (work / "layer").exists():
            if args.model not in LAYER_EDITS:
                results["cases"][case] = {"skipped": f"no layer edit for {args.model}"}
                continue
            file, text, replacement = LAYER_EDITS[args.model]
            source = work / "layer" / file
            assert text in source.read_text(), f"the layer edit no longer applies to {file}"
            source.write_text(source.read_text().replace(text, replacement))
            entry = run(case, work / "layer", doit, work / "cache-layer")
            entry["triton_kernels_compiled"] = {stage: v["kernels"].get("triton_kernels_compiled")
                                                for stage, v in (entry.get("compile_spans") or {}).items()}
        elif case == "edit":
            if args.model not in LAYER_EDITS:
                results["cases"][case] = {"skipped": f"no layer edit for {args.model}"}
                continue
            file, text, replacement = LAYER_EDITS[args.model]
            source = main_project / file
            original = source.read_text()
            assert text in original, f"the layer edit no longer applies to {file}"
            source.write_text(original.replace(text, replacement))
            try:
                run(case, main_project, doit, cache)
            finally:
                source.write_text(original)
        elif case == "method":
            flipped = "OFF" if specs_of(main_project, "decode").get("low_memory_mode") == "ON" else "ON"
            run(case, main_project, doit + [f"decode.low_memory_mode={flipped}"], cache)
        elif case == "lowmem":
            run(case, main_project, doit + ["low_memory_mode=ON"], cache)
        elif case == "cold2":
            run(case, project("cold2"), doit, work / "cache-cold2")
        elif case == "warm":
            run(case, project("warm"), doit, work / "cache-warm", {"CUDABUILD_KERNEL_CACHE": str(cache / "kernels")})
        elif case == "o0":
            run(case, project("o0"), doit + ["compile_wrapper_opt_level=O0"], work / "cache-o0")
        elif case == "pinned":
            run("pin", main_project, doit + ["autotune=pin"], cache)
            pins = main_project / "recipes" / f"{args.model}.autotune.json"
            builds = {"pinned-cold": {}, "pinned-warm": {"CUDABUILD_KERNEL_CACHE": str(work / "cache-pinned-cold" / "kernels")}}
            for name, extra in builds.items():
                root = project(name)
                if pins.exists():
                    shutil.copy(pins, root / "recipes" / pins.name)
                run(name, root, doit, work / f"cache-{name}", extra)
        elif case in ("stock", "stockwarm"):
            # stock: ExecuTorch's own lowering with inductor's caches empty, as cudabuild's cold build
            # has them; stockwarm: the same again with those caches warm (a plain re-export today).
            stock = work / "stock"
            if not stock.exists():
                stock = project("stock")
            caches = {"TORCHINDUCTOR_CACHE_DIR": str(work / "stock-inductor"), "TRITON_CACHE_DIR": str(work / "stock-triton")}
            run(case, stock, [sys.executable, "bench/baseline_lower.py", args.model, args.target, str(work / "stock-out")],
                work / "cache-stock", caches)

    cases = results["cases"]
    if "outputs" in cases.get("cold", {}) and "outputs" in cases.get("cold2", {}):
        results["identical_bytes_fresh_builds"] = cases["cold"]["outputs"] == cases["cold2"]["outputs"]
    if "outputs" in cases.get("cold", {}) and "outputs" in cases.get("warm", {}):
        results["identical_bytes_warm_kernels"] = cases["cold"]["outputs"] == cases["warm"]["outputs"]
    if "outputs" in cases.get("pinned-cold", {}) and "outputs" in cases.get("pinned-warm", {}):
        results["identical_bytes_pinned_warm_kernels"] = cases["pinned-cold"]["outputs"] == cases["pinned-warm"]["outputs"]
    if cases.get("cold", {}).get("rc") == 0:
        results["of_cold"] = {f"{case}/cold": round(cases[case]["seconds"] / cases["cold"]["seconds"], 3)
                              for case in ("cold1", "cold2w", "replay", "keepkernels", "second", "layer", "edit", "workers2", "method", "warm", "cold2", "pinned-cold", "pinned-warm") if cases.get(case, {}).get("rc") == 0}
    if cases.get("workers2", {}).get("rc") == 0 and cases.get("replay", {}).get("rc") == 0:
        results["two_workers"] = {"workers2/replay": round(cases["workers2"]["seconds"] / cases["replay"]["seconds"], 3),
                                  "compile_overlap_seconds": cases["workers2"].get("compile_overlap_seconds")}
    seconds = lambda c: {stage: {"seconds": v.get("seconds"), "C++ compile": v.get("top", {}).get("C++ compile")}
                         for stage, v in (cases.get(c, {}).get("compile_spans") or {}).items()}
    if cases.get("o0", {}).get("rc") == 0 and cases.get("cold", {}).get("rc") == 0:
        results["wrapper_O0"] = {"seconds/cold": round(cases["o0"]["seconds"] / cases["cold"]["seconds"], 3),
                                 "compile_spans_cold": seconds("cold"), "compile_spans_O0": seconds("o0")}
    stock_dir = work / "stock-out"
    if stock_dir.exists():
        results["stock_pte_sha"] = sha(stock_dir / "model.pte")
    peak = lambda c: max((v or {}).get("peak_gpu_bytes", 0) for v in (cases.get(c, {}).get("compile") or {"x": {}}).values())
    if "compile" in cases.get("cold", {}) and "compile" in cases.get("lowmem", {}):
        results["peak_gpu_bytes"] = {"low_memory_OFF": peak("cold"), "low_memory_ON": peak("lowmem")}
    if "seconds" in cases.get("stock", {}) and "seconds" in cases.get("cold", {}):
        results["ratios"] = {
            "cold/stock": cases["cold"]["seconds"] / cases["stock"]["seconds"],
            "stock/noop": cases["stock"]["seconds"] / max(cases.get("noop", {}).get("seconds", 1e9), 1e-9),
        }
        for case in COLD_WITH_JOBS:
            if "seconds" in cases.get(case, {}):
                results["ratios"][f"{case}/stock"] = cases[case]["seconds"] / cases["stock"]["seconds"]
        if "seconds" in cases.get("stockwarm", {}):
            results["ratios"]["stockwarm/noop"] = cases["stockwarm"]["seconds"] / max(cases.get("noop", {}).get("seconds", 1e9), 1e-9)
        for case in ("replay", "method"):
            if "seconds" in cases.get(case, {}):
                results["ratios"][f"stock/{case}"] = cases["stock"]["seconds"] / cases[case]["seconds"]
    save()
    print(json.dumps({k: v for k, v in results.items() if k != "cases"}, indent=1))
    stop_warm_processes(work)


if __name__ == "__main__":
    main()

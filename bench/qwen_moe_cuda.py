"""ExecuTorch's Qwen3.5-MoE on the GPU, cudabuild against the stock exporter, every case in one run.

    python bench/qwen_moe_cuda.py --out DIR [--cases cold,noop,restore,runtime,stock,parity,lowmem,memory]
                                  [--runtime .etrt/run.sh] [--layers 1,2] [--budget 560]

Cases (each a whole process; cudabuild builds in a project copy with its own cache):
  cold      `doit export model=qwen_moe target=cuda` (size tiny), empty caches
  cold2w    the cold build with two workers (CUDABUILD_JOBS=2; the default is three on cuda), in a
            fresh project, cache and kernel cache: its time against cold's
  noop      the same again: nothing runs
  restore   `rm -rf build`, then the same: every stage restored from the cache
  runtime   the package in ExecuTorch's C++ CUDA runtime (RUNTIME, ../shared/et-runtime): prefill
            then decode in one loaded program, the state shared by name, tokens checked against
            the eager model's logits (the same quantized weights); decode and prefill timed with
            --warmup/--repeat, with and without --cuda-graph, beside eager PyTorch
  stock     ExecuTorch's own exporter (`export.py --tiny-test --qlinear 4w`) with low_memory_mode
            OFF (ON, as shipped, crashes on this torch), its inductor and Triton caches empty
  parity    the two .pte files side by side: methods, their inputs and outputs, the constant
            methods (metadata), delegates and what lies outside them, file sizes
  lowmem    the cold build with low_memory_mode=ON (quantize, exports and edges come from the cache)
  memory    `size=35b-a3b layers=N` for each N of --layers, low_memory_mode in each of --modes (OFF,ON):
            the peak GPU memory of each method's compile (to the compile stages only), the slope per
            layer and its extrapolation to 40 layers; --runtime-35b adds the runtime case at the first N
  optlevel  the cold build's project copied, built with compile_wrapper_opt_level=O1 (inductor's default;
            the recipe's is O0) in the same cache: only compile, package and verify rerun; its compile
            seconds against cold's, and the runtime case on it (decode and prefill latency at O1)
  hqq       the quantize stage alone at `size=35b-a3b layers=N` (the first N) with hqq=true, then the
            same again (a no-op): HQQ's seconds beside min/max's (the memory case's quantize)
Cases are skipped once the time budget would be exceeded. Results go to OUT/qwen_moe_cuda.json,
logs of every case to OUT/logs.tar.gz.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, Bench, arguments, du  # noqa: E402,F401  (Bench, du: what the other qwen_moe benches import from here)

ESTIMATE = {"cold": 240, "cold2w": 240, "noop": 10, "restore": 15, "runtime": 60, "stock": 200, "parity": 20, "lowmem": 150,
            "memory": 300, "hqq": 120, "optlevel": 250}
MODEL, TARGET = "qwen_moe", "cuda"


def built_options(project: Path):
    """The recipe options the project's last build resolved (its manifest's), typed as the models read them."""
    from cudabuild.registry import load_recipe

    values = json.loads((project / "build" / MODEL / TARGET / "manifest.json").read_text())["options"]
    return load_recipe(project, MODEL).for_target(TARGET).defaults(TARGET).replace(**values)


# -- the stock exporter ---------------------------------------------------------------------------

def stock_exporter(low_memory: bool, real_layers: int = 0) -> Path:
    """ExecuTorch's export.py, copied, with low_memory_mode as asked (it is ON in the file); with
    `real_layers`, its --tiny-test model swapped for the real 35B-A3B config cut to that many layers
    (quantize included: it draws and quantizes that model as it would the tiny one)."""
    import executorch.examples.models.qwen3_5_moe.export as stock

    text = Path(stock.__file__).read_text()
    value = b"ON" if low_memory else b"OFF"
    patched = text.replace('CompileSpec("low_memory_mode", b"ON")', f'CompileSpec("low_memory_mode", {value!r})')
    if real_layers:
        start = patched.index("tiny_config = Qwen35MoEConfig(")
        end = patched.index("use_splitk_decode=use_splitk,", start)
        real = f"tiny_config = Qwen35MoEConfig(num_hidden_layers={real_layers}, max_seq_len=4096, "
        patched = patched[:start] + real + patched[end:]
    path = Path(tempfile.mkdtemp(prefix="stock-export-")) / "stock_export.py"
    path.write_text(patched)
    return path


# -- ExecuTorch's runtime and the eager model -------------------------------------------------------

def write_input(folder: Path, name: str, tensor) -> str:
    import torch

    path = folder / f"{name}.bin"
    t = tensor.contiguous()
    t.view(torch.uint8).numpy().tofile(path) if t.dtype == torch.bfloat16 else t.numpy().tofile(path)
    dtype = {torch.int64: "int64", torch.float32: "float32"}[t.dtype]
    shape = "x".join(str(d) for d in t.shape) or "scalar"
    return f"{dtype}:{shape}:{path}"


def runtime_timing(stderr: str) -> dict:
    found = {}
    for m in re.finditer(r"et_cuda_run: (\w+): (\d+) runs, mean ([\d.]+) ms, min ([\d.]+) ms", stderr):
        found[m.group(1)] = {"runs": int(m.group(2)), "mean_ms": float(m.group(3)), "min_ms": float(m.group(4))}
    return found


def eager_model(project: Path, cache: Path, options: dict):
    """ExecuTorch's model from the quantize stage's bundle in the cache, on the GPU."""
    sys.path.insert(0, str(project))
    from cudabuild.backend import custom_ops
    from cudabuild.engine.store import Store
    from cudabuild.models import qwen35_moe_cuda
    from executorch.examples.models.qwen3_5_moe.inference import _move_to_cuda

    custom_ops.register("cuda")  # the Triton ops the model's forward calls, with their fixes
    stamp = json.loads((project / "build" / MODEL / TARGET / ".stamps" / "quantize.json").read_text())
    store = Store(cache)
    folder = Path(tempfile.mkdtemp(prefix="bundle-"))
    for name, sha in stamp["outputs"].items():
        (folder / name).symlink_to(store.objects.verified_path(sha))
    model = qwen35_moe_cuda.load(options, folder)
    _move_to_cuda(model, model.config)
    return model.eval()


def cuda_ms(fn, warmup: int = 5, repeat: int = 50) -> dict:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"runs": repeat, "mean_ms": sum(times) / len(times), "min_ms": min(times)}


def runtime_case(bench: Bench, name: str, project: Path, cache: Path, runtime: str, options: dict, prefill_len: int) -> dict:
    """The package in ExecuTorch's runtime: prefill then decode, state shared, checked and timed."""
    import torch

    from cudabuild.models import qwen35_moe_cuda

    build = project / "build" / MODEL / TARGET
    pte, ptd = build / "model.pte", build / "aoti_cuda_blob.ptd"
    entry: dict = {"info": bench.run(f"{name}-info", [runtime, "--info", str(pte), str(ptd)], project)}
    entry["info"]["text"] = (bench.logs / f"{name}-info.log").read_text()[:6000]
    model = eager_model(project, cache, options)
    vocab, longest = model.config.vocab_size, model.config.max_seq_len - 1
    P = min(prefill_len, longest)
    prompt = (torch.arange(P) * 37 + 11) % vocab
    files = bench.work / f"{name}-inputs"
    files.mkdir(exist_ok=True)
    greedy = torch.tensor([1e-6], dtype=torch.float32)
    with torch.no_grad():
        qwen35_moe_cuda.prepare_prefill(model, options)
        prefill_logits = model(prompt[None].cuda(), torch.arange(P).cuda()).float()[0, -1].cpu()
        first = int(prefill_logits.argmax())
        qwen35_moe_cuda.prepare_decode(model, options)
        decode_logits = model(torch.tensor([[first]]).cuda(), torch.tensor([P]).cuda()).float()[0, -1].cpu()
    inputs = [write_input(files, "prompt", prompt[None]), write_input(files, "pos", torch.arange(P)),
              write_input(files, "temp", greedy)]
    dec = [write_input(files, "tok", torch.tensor([[first]])), write_input(files, "dpos", torch.tensor([P])),
           write_input(files, "temp", greedy)]
    outdir = bench.work / f"{name}-out"
    run = bench.run(f"{name}-prefill-then-decode", [runtime, str(pte), str(ptd), "prefill", str(outdir), *inputs,
                                                   "--then", "decode", *dec], project)
    entry["prefill_then_decode"] = {"rc": run["rc"], "stdout": run["stdout_tail"]}
    if run["rc"] == 0:
        got_prefill = float(next(iter(__import__("numpy").fromfile(outdir / "out_0.bin", dtype="float32"))))
        got_decode = float(next(iter(__import__("numpy").fromfile(outdir / "1_decode" / "out_0.bin", dtype="float32"))))
        for what, logits, token in (("prefill", prefill_logits, int(got_prefill)), ("decode", decode_logits, int(got_decode))):
            gap = float(logits.max() - logits[token])
            entry[what] = {"runtime_token": token, "eager_argmax": int(logits.argmax()), "logit_gap": gap,
                           "allowed": 5e-2 * float(logits.abs().max()), "ok": gap <= 5e-2 * float(logits.abs().max())}
    # Timings: the runtime (plain and with a CUDA graph), and eager on the same weights.
    timings: dict = {}
    for graph in (False, True):
        for method, args in (("decode", dec), ("prefill", inputs)):
            flags = ["--warmup", "5", "--repeat", "50"] + (["--cuda-graph", method] if graph else [])
            label = f"{method}{'-cuda-graph' if graph else ''}"
            timed = bench.run(f"{name}-time-{label}", [runtime, *flags, str(pte), str(ptd), method, str(outdir / label), *args], project)
            timings[f"runtime {label}"] = runtime_timing(timed["stderr_tail"]).get(method, {"rc": timed["rc"]})
    tok, pos, t = torch.tensor([[first]]).cuda(), torch.tensor([P]).cuda(), greedy.cuda()
    prompt_c, ppos = prompt[None].cuda(), torch.arange(P).cuda()
    with torch.no_grad():
        qwen35_moe_cuda.prepare_decode(model, options)
        timings["eager decode"] = cuda_ms(lambda: model(tok, pos, t))
        qwen35_moe_cuda.prepare_prefill(model, options)
        timings["eager prefill"] = cuda_ms(lambda: model(prompt_c, ppos, t), warmup=3, repeat=20)
    entry["timings"] = timings
    entry["prefill_tokens"] = P
    del model
    torch.cuda.empty_cache()
    return entry


# -- the two .pte files side by side ----------------------------------------------------------------

def describe_pte(path: Path) -> dict:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(path.read_bytes()).program
    out = {"bytes": path.stat().st_size, "methods": {}}
    for plan in program.execution_plan:
        values = plan.values

        def describe(index):
            v = values[index].val
            kind = type(v).__name__
            if kind == "Tensor":
                return {"tensor": int(v.scalar_type), "sizes": list(v.sizes), "dim_order": list(v.dim_order)}
            if kind in ("Int", "Double", "Bool"):
                return {kind.lower(): getattr(v, f"{kind.lower()}_val")}
            if kind == "String":
                return {"string": v.string_val}
            return {kind: str(v)[:200]}

        delegates = [{"id": d.id, "specs": {s.key: bytes(s.value).decode(errors="replace") for s in d.compile_specs}}
                     for d in plan.delegates]
        operators = sorted(f"{op.name}.{op.overload}" for op in plan.operators)
        out["methods"][plan.name] = {"inputs": [describe(i) for i in plan.inputs],
                                     "outputs": [describe(i) for i in plan.outputs],
                                     "delegates": delegates, "operators": operators,
                                     "non_const_buffer_sizes": list(plan.non_const_buffer_sizes)}
    return out


def parity(ours: Path, stock: Path) -> dict:
    a, b = describe_pte(ours), describe_pte(stock)
    report = {"ours": a, "stock": b, "same_methods": sorted(a["methods"]) == sorted(b["methods"]), "differences": []}
    for name in sorted(set(a["methods"]) | set(b["methods"])):
        ma, mb = a["methods"].get(name), b["methods"].get(name)
        if ma is None or mb is None:
            report["differences"].append(f"{name}: only in {'stock' if ma is None else 'ours'}")
            continue
        for part in ("inputs", "outputs", "operators", "non_const_buffer_sizes"):
            if ma[part] != mb[part]:
                report["differences"].append(f"{name}.{part}: ours {ma[part]} stock {mb[part]}")
        da = [d["id"] for d in ma["delegates"]]
        db = [d["id"] for d in mb["delegates"]]
        if da != db:
            report["differences"].append(f"{name}.delegates: ours {da} stock {db}")
        for i, (x, y) in enumerate(zip(ma["delegates"], mb["delegates"])):
            if x["specs"] != y["specs"]:
                report["differences"].append(f"{name}.delegate[{i}].compile_specs: ours {x['specs']} stock {y['specs']}")
    return report


# -- main -------------------------------------------------------------------------------------------

def main() -> None:
    args = arguments(__doc__, budget=560, extra=(
        (("--cases",), {"default": "cold,noop,restore,runtime,stock,parity"}),
        (("--runtime",), {"default": str(ROOT / ".etrt" / "run.sh")}),
        (("--layers",), {"default": "1,2", "help": "the memory case's layer counts"}),
        (("--runtime-35b",), {"action": "store_true"}),
        (("--modes",), {"default": "OFF,ON", "help": "the memory case's low_memory_mode values"}),
        (("--set",), {"action": "append", "default": [], "metavar": "NAME=VALUE"})))
    out = args.out
    bench = Bench(out, args.budget)
    results = bench.results
    main_project, cache = bench.project("main"), bench.work / "cache-main"
    import torch

    results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    results["torch"] = torch.__version__
    for case in args.cases.split(","):
        if not bench.fits(case, ESTIMATE[case]):
            continue
        try:
            if case in ("cold", "noop"):
                results["cases"][case] = bench.build(case, main_project, cache, *args.set)
            elif case == "cold2w":
                # The same cold build with two workers, in a fresh project, cache and kernel cache.
                fresh = bench.work / "cache-cold2w"
                results["cases"][case] = bench.build(case, bench.project("cold2w"), fresh, *args.set,
                                                     env={"CUDABUILD_JOBS": "2", "CUDABUILD_KERNEL_CACHE": str(fresh / "kernels")})
            elif case == "restore":
                shutil.rmtree(main_project / "build", ignore_errors=True)
                results["cases"][case] = bench.build(case, main_project, cache, *args.set)
            elif case == "runtime":
                options = built_options(main_project)
                results["cases"][case] = runtime_case(bench, "runtime", main_project, cache, args.runtime, options, 63)
            elif case == "stock":
                script = stock_exporter(low_memory=False)
                stock_out = bench.work / "stock-out"
                env = {"TORCHINDUCTOR_CACHE_DIR": str(bench.work / "stock-inductor"),
                       "TRITON_CACHE_DIR": str(bench.work / "stock-triton")}
                entry = bench.run("stock", [sys.executable, str(script), "--tiny-test", "--qlinear", "4w",
                                            "--output-dir", str(stock_out)], bench.work, env)
                peak = re.search(r"EXPORT_GPU_PEAK_MEMORY_MB: ([\d.]+)", entry["stdout_tail"])
                entry["peak_gpu_mb"] = float(peak.group(1)) if peak else None
                results["cases"][case] = entry
                if (stock_out / "model.pte").exists() and (stock_out / "model.pte").stat().st_size < 15 << 20:
                    shutil.copy(stock_out / "model.pte", out / "stock.pte")
            elif case == "parity":
                ours = main_project / "build" / MODEL / TARGET / "model.pte"
                stock = bench.work / "stock-out" / "model.pte"
                report = parity(ours, stock)
                report["ptd_bytes"] = {"ours": (ours.parent / "aoti_cuda_blob.ptd").stat().st_size,
                                       "stock": (stock.parent / "aoti_cuda_blob.ptd").stat().st_size}
                results["cases"][case] = report
                if ours.stat().st_size < 15 << 20:
                    shutil.copy(ours, out / "ours.pte")
            elif case == "lowmem":
                results["cases"][case] = bench.build("lowmem", main_project, cache, "low_memory_mode=ON", *args.set)
            elif case == "memory":
                results["cases"][case] = memory_case(bench, args)
            elif case == "optlevel":
                results["cases"][case] = optlevel_case(bench, cache, args)
            elif case == "hqq":
                results["cases"][case] = hqq_case(bench, args)
        except Exception as e:  # one case's failure must not cost the others
            import traceback

            results["cases"][case] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(f"{case:<24} error: {type(e).__name__}: {e}", flush=True)
        bench.save()
    cases = results["cases"]
    if cases.get("optlevel", {}).get("rc") == 0 and "stages" in cases.get("cold", {}):
        results["wrapper_O0_vs_O1"] = {
            "compile_seconds_O0": {k: v["seconds"] for k, v in cases["cold"]["stages"].items() if k.startswith("compile")},
            "compile_seconds_O1": cases["optlevel"]["compile_seconds"],
            "timings_O0": (cases.get("runtime") or {}).get("timings"),
            "timings_O1": (cases["optlevel"].get("runtime") or {}).get("timings")}
    if "seconds" in cases.get("cold", {}) and "seconds" in cases.get("stock", {}):
        results["ratios"] = {"cold/stock": cases["cold"]["seconds"] / cases["stock"]["seconds"]}
    if cases.get("cold", {}).get("rc") == 0 and cases.get("cold2w", {}).get("rc") == 0:
        results.setdefault("ratios", {})["cold2w/cold"] = cases["cold2w"]["seconds"] / cases["cold"]["seconds"]
    bench.finish(keep=True)  # the runtime cases read its projects afterwards; a session's machine is reclaimed anyway
    print(json.dumps({k: v for k, v in results.items() if k != "cases"}, indent=1))


def memory_case(bench: Bench, args) -> dict:
    """Peak GPU memory of each method's compile at the real shapes, low_memory_mode OFF and ON."""
    rows, table = {}, []
    for n in [int(x) for x in args.layers.split(",") if x]:
        project, cache = bench.project(f"mem{n}"), bench.work / f"cache-mem{n}"
        settings = ["size=35b-a3b", f"layers={n}", *args.set]
        for mode in args.modes.split(","):
            if bench.left() < 90:
                rows[f"{n}/{mode}"] = {"skipped": "time budget"}
                continue
            entry = bench.build(f"mem{n}-{mode}", project, cache, *settings, f"low_memory_mode={mode}",
                                tasks=("export:compile.decode", "export:compile.prefill"))
            # After a failure the stamps are the previous mode's: its peaks are not this row's.
            peaks = {stage: (s.get("value") or {}).get("peak_gpu_bytes") for stage, s in entry["stages"].items()
                     if stage.startswith(("compile", "quantize"))} if entry["rc"] == 0 else {"failed": True}
            rows[f"{n}/{mode}"] = {"rc": entry["rc"], "seconds": entry["seconds"], "peaks": peaks,
                                   "stages": entry["stages"], "stderr_tail": entry["stderr_tail"]}
            table.append({"layers": n, "low_memory_mode": mode, **{k: v for k, v in peaks.items()}})
        if args.runtime_35b and n == int(args.layers.split(",")[0]) and bench.left() > 150:
            done = bench.build(f"mem{n}-package", project, cache, *settings, "low_memory_mode=OFF")
            rows[f"{n}/package"] = {"rc": done["rc"], "verify": done.get("verify"), "seconds": done["seconds"],
                                    "verify_failed": done.get("verify_failed"), "stderr_tail": done["stderr_tail"]}
            if done["rc"] == 0:
                options = built_options(project)
                rows[f"{n}/runtime"] = runtime_case(bench, f"runtime35b-{n}", project, cache, args.runtime, options, 127)
    return {"rows": rows, "table": table}


def optlevel_case(bench: Bench, cache: Path, args) -> dict:
    """The wrapper's C++ at -O1 against the recipe's -O0: compile seconds, and latency in the runtime."""
    project = bench.project("o1")
    entry = bench.build("optlevel-O1", project, cache, "compile_wrapper_opt_level=O1", *args.set)
    row = {"rc": entry["rc"], "seconds": entry["seconds"], "statuses": entry.get("statuses"),
           "compile_seconds": {stage: s["seconds"] for stage, s in entry["stages"].items() if stage.startswith("compile")},
           "verify": entry.get("verify"), "stderr_tail": entry["stderr_tail"]}
    if entry["rc"] == 0:
        options = built_options(project)
        row["runtime"] = runtime_case(bench, "runtime-O1", project, cache, args.runtime, options, 63)
    return row


def hqq_case(bench: Bench, args) -> dict:
    """The quantize stage with HQQ at the real shapes, then a no-op of it."""
    n = int(args.layers.split(",")[0])
    project, cache = bench.project(f"hqq{n}"), bench.work / f"cache-hqq{n}"
    settings = ["size=35b-a3b", f"layers={n}", "hqq=true", *args.set]
    rows = {}
    for name in ("cold", "noop"):
        entry = bench.build(f"hqq{n}-{name}", project, cache, *settings, tasks=("export:quantize",))
        rows[name] = {"rc": entry["rc"], "seconds": entry["seconds"], "quantize": entry["stages"].get("quantize"),
                      "stderr_tail": entry["stderr_tail"]}
        if entry["rc"] != 0:
            break
    return rows


if __name__ == "__main__":
    main()

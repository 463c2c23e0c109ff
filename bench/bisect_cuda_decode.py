"""Bisect the cuda decode miscompile: which graph form or inductor option makes AOTInductor wrong.

    python bench/bisect_cuda_decode.py [--model tiny_lm] [--method decode] [--out DIR] [--budget S]

Each case compiles one variant of the method's program with AOTInductor for cuda (cudabuild's own
options unless the case changes them), runs it through torch's AOTI runner with fresh constants
and compares it with the eager model. A line per case goes to OUT/bisect.jsonl as soon as it is
known, so a run cut short still says everything it learned; a case that crashes the process is
recorded as such and the next run of the worker carries on after it.

Program variants: `raw` (torch.export, conv1d -> conv2d only), `edge` (what the backend is handed:
cudabuild's edge stage), `edge+views` (every *_copy view op turned back into its view), one
kind at a time, `edge+scalars` (lifted 0-d constants inlined) and `raw+copies` (the reverse).

What it found on the H200 (torch 2.11, 2026-12-01), before cudabuild fixed the input order: raw
and raw+copies right, every edge variant wrong by the same 2.16, with or without Triton GEMMs, and
`edge.eager` refused the method's inputs ("expected torch.Size([1]) ... at *args[0]"): the
program ExecuTorch hands the backend takes (input_pos, tokens). See cudabuild.backend.calling_convention
and bench/repro_cuda_decode.py. (That run reused one program object across the option cases, which
the compile frees; each case now compiles a private copy.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # --device cpu checks the script itself on a machine without a GPU
sys.path.insert(0, str(ROOT))

VIEW_OF_COPY = {  # name of the copy overload -> name of the view overload
    "view_copy.default": "view.default",
    "transpose_copy.int": "transpose.int",
    "unsqueeze_copy.default": "unsqueeze.default",
    "permute_copy.default": "permute.default",
    "squeeze_copy.dims": "squeeze.dims",
    "squeeze_copy.dim": "squeeze.dim",
    "expand_copy.default": "expand.default",
    "alias_copy.default": "alias.default",
    "t_copy.default": "t.default",
}


def _aten(name: str):
    import torch

    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _op_name(target) -> str | None:
    """`packet.overload` of an aten (or edge-dialect aten) op, e.g. "transpose_copy.int"."""
    schema = getattr(target, "_schema", None)  # edge-dialect ops carry their aten op's schema too
    if schema is None or not schema.name.startswith("aten::"):
        return None
    return f"{schema.name.split('::')[1]}.{schema.overload_name or 'default'}"


def retarget(ep, mapping: dict[str, str]):
    """A copy of `ep` whose call_function nodes named in `mapping` call the mapped aten op instead."""
    ep = copy.deepcopy(ep)
    changed = 0
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function":
            name = _op_name(node.target)
            if name in mapping:
                node.target = _aten(mapping[name])
                changed += 1
    ep.graph_module.recompile()
    return ep, changed


def inline_scalar_constants(ep):
    """A copy of `ep` where binary ops read 0-d lifted constants as Python scalars."""
    import torch

    ep = copy.deepcopy(ep)
    values = dict(ep.state_dict)
    values.update(ep.constants)
    by_placeholder = {}
    for spec in ep.graph_signature.input_specs:
        if spec.target in values and isinstance(values[spec.target], torch.Tensor) and values[spec.target].dim() == 0:
            by_placeholder[spec.arg.name] = values[spec.target].item()
    changed = 0
    scalar_of = {"div.Tensor": "div.Scalar", "mul.Tensor": "mul.Scalar", "add.Tensor": "add.Scalar", "sub.Tensor": "sub.Scalar"}
    for node in ep.graph_module.graph.nodes:
        name = _op_name(node.target) if node.op == "call_function" else None
        if name in scalar_of and len(node.args) == 2 and getattr(node.args[1], "name", None) in by_placeholder:
            node.args = (node.args[0], by_placeholder[node.args[1].name])
            node.target = _aten(scalar_of[name])
            changed += 1
    ep.graph_module.recompile()
    return ep, changed


def build(model_name: str, method_name: str):
    import torch
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from cudabuild.backend import delegate
    from cudabuild.registry import load_recipe
    from cudabuild.specs import resolve_method_specs
    from cudabuild.backend.stages.edge import backend_passes
    from torch._inductor.decomposition import conv1d_to_conv2d

    recipe = load_recipe(ROOT, model_name)
    model = recipe.build(recipe.defaults("cpu"))
    method = next(m for m in recipe.methods if m.name == method_name)
    specs = resolve_method_specs(DEVICE, [m.name for m in recipe.methods], recipe.specs, {m.name: m.specs for m in recipe.methods}, {})[method_name]
    inputs = tuple(method.inputs(model))
    shapes = method.dynamic_shapes(model) if method.dynamic_shapes else None
    reference_model = copy.deepcopy(model).to(DEVICE)
    with torch.no_grad():
        expected = reference_model(*(t.to(DEVICE) for t in inputs)).detach().cpu()
    ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    raw = copy.deepcopy(ep).run_decompositions({torch.ops.aten.conv1d.default: conv1d_to_conv2d})
    with delegate.capture() as captured:
        to_edge_transform_and_lower({method_name: ep}, partitioner={method_name: [delegate.partitioner(method_name, {}, DEVICE)]},
                                    compile_config=EdgeCompileConfig(_check_ir_validity=False))
    edge = backend_passes(captured[method_name][0], specs)
    return raw, edge, inputs, expected, specs


def histogram(ep) -> dict:
    counts: dict = {}
    for node in ep.graph.nodes:
        if node.op == "call_function":
            name = _op_name(node.target) or str(node.target)
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def compile_and_run(ep, inputs, options: dict, low_memory: bool, trace_dir: Path | None):
    import torch
    from executorch.backends.cuda.passes.move_cond_predicate_to_cpu import MoveCondPredicateToCpuPass
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cudabuild.backend import lowmem
    from cudabuild.backend.fallbacks import collect_fallbacks
    from cudabuild.backend.stages.compile import user_input_values
    from cudabuild.backend.stages.verify import run_compiled

    if trace_dir is not None:
        options = dict(options, **{"trace.enabled": True, "trace.debug_dir": str(trace_dir)})
    ep = lowmem.move_program_to_device(ep, DEVICE, low_memory=low_memory)
    if DEVICE == "cuda":
        MoveCondPredicateToCpuPass()(ep)
    with contextlib.ExitStack() as scope:
        fallbacks = scope.enter_context(collect_fallbacks())
        scope.enter_context(torch.no_grad())
        scope.enter_context(sdpa_kernel([SDPBackend.MATH]))
        if low_memory:
            scope.enter_context(lowmem.compile_time_cpu_clones(torch.device(DEVICE)))
        paths = torch._inductor.aot_compile(ep.module(), user_input_values(ep), options=options)
    lowmem.release_device_tensors(ep)
    so = next(p for p in paths if p.endswith(".wrapper.so"))
    blob = next(p for p in paths if p.endswith(".wrapper_weights.blob"))
    if trace_dir is not None:
        for p in paths:
            if p.endswith(".cpp"):
                (trace_dir / Path(p).name).write_bytes(Path(p).read_bytes())
    outputs = run_compiled(so, blob, inputs, DEVICE)
    return outputs[-1].detach().cpu(), sorted(fallbacks)


def jit_run(ep, inputs, options: dict):
    import torch
    from torch.export.passes import move_to_device_pass

    ep = move_to_device_pass(copy.deepcopy(ep), DEVICE)
    keep = {k: v for k, v in options.items() if k.startswith("max_autotune") or k in ("emulate_precision_casts", "loop_ordering_after_fusion", "prologue_fusion", "epilogue_fusion")}
    torch._dynamo.reset()
    compiled = torch.compile(ep.module(), options=keep)
    with torch.no_grad():
        out = compiled(*(t.to(DEVICE) for t in inputs))
    out = out[-1] if isinstance(out, (list, tuple)) else out
    return out.detach().cpu()


def eager_run(ep, inputs):
    import torch
    from torch.export.passes import move_to_device_pass

    ep = move_to_device_pass(copy.deepcopy(ep), DEVICE)
    with torch.no_grad():
        out = ep.module()(*(t.to(DEVICE) for t in inputs))
    out = out[-1] if isinstance(out, (list, tuple)) else out
    return out.detach().cpu()


def cases(raw, edge, options: dict):
    """(name, program, options, how) in the order that tells the most soonest."""
    all_views = dict(VIEW_OF_COPY)
    kinds = ("transpose_copy.int", "view_copy.default", "unsqueeze_copy.default")
    yield "edge.eager", edge, options, "eager"
    yield "raw", raw, options, "aot"
    yield "edge", edge, options, "aot"
    yield "edge+views", retarget(edge, all_views), options, "aot"
    for kind in kinds:
        yield f"edge+views[{kind}]", retarget(edge, {kind: VIEW_OF_COPY[kind]}), options, "aot"
    yield "edge.prologue_fusion=False", edge, dict(options, prologue_fusion=False), "aot"
    yield "edge.gemm=ATEN", edge, dict(options, max_autotune_gemm_backends="ATEN"), "aot"
    yield "edge+scalars", inline_scalar_constants(edge), options, "aot"
    yield "raw+copies", retarget(raw, {v: k for k, v in all_views.items()}), options, "aot"
    yield "edge.epilogue_fusion=False", edge, dict(options, epilogue_fusion=False), "aot"
    yield "edge.jit", edge, options, "jit"
    for kind in kinds:
        yield f"edge+views[all but {kind}]", retarget(edge, {k: v for k, v in all_views.items() if k != kind}), options, "aot"
    yield "edge.max_autotune=False+conv=ATEN", edge, dict(options, max_autotune=False, max_autotune_conv_backends="ATEN"), "aot"
    yield "edge.emulate_precision_casts=False", edge, dict(options, emulate_precision_casts=False), "aot"
    yield "edge.low_memory", edge, options, "aot-lowmem"
    yield "edge.loop_ordering_after_fusion=True", edge, dict(options, loop_ordering_after_fusion=True), "aot"


TRACED = ("raw", "edge", "edge+views")


def keep_kernel_sources(cache: Path, into: Path) -> None:
    """Copy the Triton kernel sources a traced case compiled (its private inductor dir's *.py)."""
    into.mkdir(parents=True, exist_ok=True)
    for source in cache.rglob("*.py"):
        if "triton" not in source.parts:
            (into / source.name).write_bytes(source.read_bytes())


def worker(args) -> None:
    import torch

    from cudabuild.backend.aoti_options import aoti_options, with_custom_shims
    from cudabuild.backend.cuda_env import scoped_environ
    from cudabuild.backend.stages.compile import compile_environment
    from cudabuild.backend.toolchain import probe

    out = Path(args.out)
    results = out / "bisect.jsonl"
    done = {json.loads(line)["case"] for line in results.read_text().splitlines()} if results.exists() else set()
    started = out / "started.txt"
    if started.exists():  # the previous worker died inside this case
        crashed = started.read_text().strip()
        if crashed not in done:
            with results.open("a") as f:
                f.write(json.dumps({"case": crashed, "error": "the process died in this case"}) + "\n")
            done.add(crashed)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    raw, edge, inputs, expected, specs = build(args.model, args.method)
    toolchain = probe(DEVICE)
    options = with_custom_shims(aoti_options(specs, DEVICE, toolchain))
    import triton

    device_name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    (out / "programs.txt").write_text(f"torch {torch.__version__} triton {triton.__version__} {device_name}\nspecs {specs}\noptions {options}\n\nraw {histogram(raw)}\n\nedge {histogram(edge)}\n\n"
                                      f"{edge.graph_module.code}\n")
    print(f"built programs in {time.monotonic() - t0:.1f}s", flush=True)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache.with_name(cache.name + "-triton")))
    scale = max(1.0, expected.abs().max().item())
    for name, program, case_options, how in cases(raw, edge, options):
        if isinstance(program, tuple):
            program, changed = program
        else:
            changed = None
        if name in done or (args.only and name not in args.only.split(",")):
            continue
        if time.monotonic() > deadline:
            print(f"{name}: skipped (budget)", flush=True)
            continue
        started.write_text(name)
        entry = {"case": name, "how": how, "changed_nodes": changed}
        t = time.monotonic()
        try:
            # A traced case compiles in a private inductor dir, so its kernel sources are its own;
            # the others share one, and every case shares Triton's compile cache.
            trace = out / "code" / name if name in TRACED else None
            inductor_dir = cache.with_name(cache.name + "-" + name) if trace else cache
            if how == "eager":
                got, fallbacks = eager_run(program, inputs), []
            elif how == "jit":
                got, fallbacks = jit_run(program, inputs, case_options), []
            else:
                with scoped_environ(compile_environment(DEVICE, toolchain, inductor_dir)):
                    # A private copy: the compile moves its program to the device and frees it after.
                    got, fallbacks = compile_and_run(copy.deepcopy(program), inputs, case_options, how == "aot-lowmem", trace)
                if trace:
                    keep_kernel_sources(inductor_dir, trace / "kernels")
            diff = (got.float() - expected.float()).abs().max().item()
            entry.update(max_abs_diff=diff, right=diff <= 1e-4 * scale, fallbacks=fallbacks)
        except Exception as e:
            entry.update(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                         traceback=traceback.format_exc()[-3000:])
        entry["seconds"] = round(time.monotonic() - t, 1)
        with results.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        started.unlink()
        verdict = "error " + entry["error"] if "error" in entry else ("RIGHT" if entry["right"] else "WRONG")
        print(f"{name:<44} {verdict:<8} diff={entry.get('max_abs_diff', float('nan')):.3g} {entry['seconds']}s", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny_lm")
    parser.add_argument("--method", default="decode")
    parser.add_argument("--out", default=os.environ.get("OUT", "bisect-out"))
    parser.add_argument("--cache", default="/tmp/cudabuild-bisect-inductor")
    parser.add_argument("--budget", type=float, default=480)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    start = time.monotonic()
    # A case that kills the process (a bad kernel can) is recorded by the next worker, which
    # carries on after it.
    for _ in range(4):
        budget_left = args.budget - (time.monotonic() - start)
        if budget_left <= 0:
            break
        done = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--method", args.method,
                               "--out", args.out, "--cache", args.cache, "--budget", str(budget_left), "--device", args.device, "--only", args.only])
        if done.returncode == 0:
            break
    results = Path(args.out) / "bisect.jsonl"
    if results.exists():
        print(results.read_text())


if __name__ == "__main__":
    main()

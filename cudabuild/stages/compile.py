"""compile: AOTInductor on one method's edge program -> model.so + weights.blob.

Everything process-global the compile touches is scoped to it and undone afterwards, also on
error: the environment (a fixed inductor cache path, which ends up embedded in the .so, and on
cuda the probed TRITON_PTXAS_PATH / TORCH_CUDA_ARCH_LIST plan), the fallback-kernel collector, the
SDPA backend choice, and with low_memory_mode=ON the KV-freeing device move and the CPU-clone
patches (cudabuild.lowmem). Device memory the method held is released before returning, so the
next method starts from an empty device.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from ..aoti_options import aoti_options, with_custom_shims
from ..cuda_env import scoped_environ
from ..errors import CompileFailed, one_line
from ..fallbacks import collect_fallbacks, unsupported_on_cuda
from ..programs import load_program
from ..runner import StageResult

DEFAULT_INDUCTOR_DIR = "/tmp/cudabuild-inductor"


def inductor_cache_dir() -> str:
    # A fixed absolute path: inductor embeds it in the generated wrapper, so builds on different
    # machines (or after a cache wipe) only give identical bytes if it is the same everywhere.
    return os.environ.get("CUDABUILD_INDUCTOR_DIR", DEFAULT_INDUCTOR_DIR)


def compile_environment(target: str, toolchain: dict) -> dict[str, str]:
    env = {"TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}
    if target == "cuda":
        env.update((toolchain.get("cuda") or {}).get("env") or {})
    return env


def user_input_values(ep) -> tuple:
    names = set(ep.graph_signature.user_inputs)
    return tuple(n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in names)


def run(ctx) -> StageResult:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import lowmem

    method, target = ctx.stage.method, ctx.config.target
    specs = dict(ctx.config.specs[method])
    toolchain = ctx.upstream("probe")["value"]
    low_memory = specs.get("low_memory_mode") == "ON"
    device = "cuda" if target == "cuda" else "cpu"
    ep = load_program(lambda name: ctx.blob("edge", method, name))

    with scoped_environ(compile_environment(target, toolchain)), contextlib.ExitStack() as scope:
        ep = lowmem.move_program_to_device(ep, device, low_memory=low_memory)
        try:
            if target == "cuda":
                from executorch.backends.cuda.passes.move_cond_predicate_to_cpu import MoveCondPredicateToCpuPass

                MoveCondPredicateToCpuPass()(ep)
            options = with_custom_shims(aoti_options(specs, target, toolchain))
            fallbacks = scope.enter_context(collect_fallbacks())
            scope.enter_context(torch.no_grad())
            # SDPA left in the graph (triton_kernel_mode=OFF) must decompose: force the math kernel.
            scope.enter_context(sdpa_kernel([SDPBackend.MATH]))
            if low_memory:
                scope.enter_context(lowmem.compile_time_cpu_clones(torch.device(device)))
            try:
                paths = torch._inductor.aot_compile(ep.module(), user_input_values(ep), options=options)
            except Exception as e:
                raise CompileFailed(f"method {method}: AOTInductor compile failed: {one_line(e)}") from e
            missing = unsupported_on_cuda(fallbacks) if target == "cuda" else []
            if missing:
                raise CompileFailed(
                    f"method {method} needs {len(missing)} fallback kernel(s) the ExecuTorch CUDA runtime lacks: "
                    f"{', '.join(missing)}; rewrite those ops or enable triton_kernel_mode"
                )
            used = sorted(fallbacks)
        finally:
            lowmem.release_device_tensors(ep)

    so = next((p for p in paths if p.endswith(".wrapper.so")), None)
    blob = next((p for p in paths if p.endswith(".wrapper_weights.blob")), None)
    if so is None or blob is None:
        raise CompileFailed(f"method {method}: AOTInductor produced no .so/weights blob pair: {paths}")
    files = {"model.so": ctx.workdir / "model.so", "weights.blob": ctx.workdir / "weights.blob"}
    shutil.move(so, files["model.so"])
    shutil.move(blob, files["weights.blob"])
    report = {"fallback_kernels": used, "options": {k: v for k, v in options.items() if isinstance(v, (bool, str, int))}}
    files["compile.json"] = ctx.workdir / "compile.json"
    files["compile.json"].write_text(json.dumps(report, indent=1, sort_keys=True))
    return StageResult(files, value={"fallback_kernels": used})

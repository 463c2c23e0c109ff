"""The plain ExecuTorch-style lowering that cudabuild is measured against: no cache, no stages.

    python bench/baseline_lower.py MODEL TARGET OUT_DIR

Exports every method of recipes/MODEL.py and lowers them in one `to_edge_transform_and_lower`
call, then writes model.pte + the .ptd. On cuda it uses ExecuTorch's own `CudaPartitioner` with
the recipe's specs; on cpu (ExecuTorch has no CPU AOTI backend) ExecuTorch's own `AotiBackend`
mix-in driven with CPU options, i.e. the stock preprocess code path on the host CPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_backend():
    import torch
    from executorch.backends.aoti.aoti_backend import AotiBackend
    from executorch.backends.cuda.passes.replace_int64_floordiv import ReplaceInt64FloorDivWithFloatPass
    from executorch.exir.backend.backend_details import BackendDetails
    from torch._inductor.decomposition import conv1d_to_conv2d

    from cudabuild.backend.aoti_options import aoti_options
    from cudabuild.specs import SPEC_TABLE

    class EveryKernel(dict):
        def __contains__(self, key):  # CPU fallbacks resolve in libtorch: none is missing
            return True

    class BaselineAotiCpu(AotiBackend, BackendDetails):
        @classmethod
        def get_device_name(cls):
            return "cpu"

        @classmethod
        def get_supported_fallback_kernels(cls):
            return EveryKernel()

        @classmethod
        def get_decomposition_table(cls):
            return {torch.ops.aten.conv1d.default: conv1d_to_conv2d}

        @classmethod
        def get_aoti_compile_options(cls, compile_specs):
            # ExecuTorch hands every compile spec, `method_name` among them; the options come
            # from the specs of cudabuild's table alone, as its compile stage takes them.
            specs = {s.key: s.value.decode() for s in compile_specs if s.key in SPEC_TABLE}
            return aoti_options(specs, "cpu", {})

        @classmethod
        def get_custom_passes(cls, compile_specs):
            return [ReplaceInt64FloorDivWithFloatPass()]

        @classmethod
        def save_data_externally(cls):
            return True

    return BaselineAotiCpu


def main(model_name: str, target: str, out: str) -> None:
    import torch
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    from cudabuild.registry import load_recipe
    from cudabuild.specs import resolve_method_specs

    start = time.monotonic()
    recipe = load_recipe(ROOT, model_name)
    model = recipe.build(recipe.defaults("cpu"))
    methods = [m.name for m in recipe.methods]
    specs = resolve_method_specs(target, methods, recipe.specs, {m.name: m.specs for m in recipe.methods}, {})
    programs = {}
    for method in recipe.methods:
        shapes = method.dynamic_shapes(model) if method.dynamic_shapes else None
        programs[method.name] = torch.export.export(model, tuple(method.inputs(model)), dynamic_shapes=shapes, strict=False)
    partitioners = {}
    # Keep the class alive: ExecuTorch finds backends among live BackendDetails subclasses.
    backend = cpu_backend() if target == "cpu" else None
    for name in methods:
        compile_specs = [CompileSpec("method_name", name.encode())] + [CompileSpec(k, v.encode()) for k, v in specs[name].items()]
        if target == "cuda":
            from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

            partitioners[name] = [CudaPartitioner(compile_specs)]
        else:
            from executorch.backends.aoti.aoti_partitioner import AotiPartitioner

            partitioners[name] = [AotiPartitioner(backend.__name__, compile_specs)]
    edge = to_edge_transform_and_lower(
        programs, partitioner=partitioners, compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=recipe.constant_methods(model) if recipe.constant_methods else None,
    )
    program = edge.to_executorch()
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "model.pte", "wb") as f:
        program.write_to_file(f)
    program.write_tensor_data_to_file(out)
    print(f"baseline: {model_name}/{target} lowered in {time.monotonic() - start:.1f}s -> {out}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a recipe of recipes/")
    parser.add_argument("target", choices=("cpu", "cuda"))
    parser.add_argument("out", help="where model.pte and the .ptd go")
    args = parser.parse_args()
    main(args.model, args.target, args.out)

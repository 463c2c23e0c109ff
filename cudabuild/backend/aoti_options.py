"""AOTInductor options from a method's specs, the target and the probed toolchain.

Fixed choices, and why: kernels are embedded in the .so and, on cuda, libtorch is not linked
(the ExecuTorch runtime provides only its own shim set); constants go to a separate binary blob (the
.ptd) instead of the .so; loop ordering after fusion stays off (the backend's sdpa decomposition
needs it). On cuda, GEMM and convolution tuning uses Triton templates only (ATen choices would call
libtorch); on cpu, ATen and C++ templates (Triton has no CPU GEMM choice). The result is plain
data apart from the custom-op shim map, which needs torch ops and is added by `with_custom_shims`.
"""

from __future__ import annotations

from typing import Any, Mapping

from cudabuild.specs import inductor_options


def aoti_options(specs: Mapping[str, str], target: str, toolchain: Mapping[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {
        "loop_ordering_after_fusion": False,
        "aot_inductor.embed_kernel_binary": True,
        "aot_inductor.link_libtorch": False,
        "aot_inductor.package": True,
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.package_constants_on_disk_format": "binary_blob",
    }
    options.update(inductor_options(specs))  # the ON/OFF specs, each the option its row in the spec table names
    if "compile_wrapper_opt_level" in specs:
        # The wrapper only launches kernels: ExecuTorch's Qwen3.5-MoE exporter measured -O0 about
        # 8x faster to compile than the default -O1, with no runtime cost.
        options["aot_inductor.compile_wrapper_opt_level"] = specs["compile_wrapper_opt_level"]
    if target == "cuda":
        options["max_autotune_gemm_backends"] = "TRITON"
        options["max_autotune_conv_backends"] = "TRITON"
        options["aot_inductor.emit_multi_arch_kernel"] = bool((toolchain.get("cuda") or {}).get("emit_multi_arch_kernel"))
        if specs.get("platform") == "windows":
            options.update({
                "aot_inductor.cross_target_platform": "windows",
                "aot_inductor.aoti_shim_library": "aoti_cuda_shims",
                "aot_inductor.aoti_shim_library_path": specs.get("shim_library_path") or _default_shim_dir(),
                "aot_inductor.precompile_headers": False,
            })
    else:
        options["max_autotune_gemm_backends"] = "ATEN,CPP"
        options["max_autotune_conv_backends"] = "ATEN"
        # The cpu artifact runs under torch's own AOTI runner, where libtorch is present anyway;
        # without it the C++ GEMM templates' benchmark harness fails to load (aoti_torch_check).
        options["aot_inductor.link_libtorch"] = True
    return options


def _default_shim_dir() -> str:
    from importlib import resources

    return str(resources.files("executorch").joinpath("data/lib"))


def with_custom_shims(options: dict[str, Any]) -> dict[str, Any]:
    """Add ExecuTorch's quantized-matmul C shims when those custom ops are registered."""
    import torch

    signatures = {
        "int4_plain_mm": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
        "int6_plain_mm": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
        "int8_plain_mm": "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*",
    }
    shims = {}
    for name, args in signatures.items():
        try:
            op = getattr(torch.ops.executorch_cuda, name).default
        except (AttributeError, RuntimeError):
            continue  # op library not loaded: no model can use it
        shims[op] = [f"AOTITorchError aoti_torch_cuda_{name}({args})"]
    if shims:
        options = dict(options, **{"aot_inductor.custom_ops_to_c_shims": shims})
    return options

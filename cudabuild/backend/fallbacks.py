"""Which aten fallback kernels a compile emits, and which of them the CUDA runtime can run.

AOTInductor calls ops it does not generate code for through C shims (`aoti_torch_cuda_<op>`) or
a runtime op lookup. ExecuTorch's CUDA runtime implements only a handful of them, so a .so that
calls any other would fail at load time on the device. The collector records every fallback the
C++ wrapper emits while it is active; the compile stage turns unsupported ones into one error
that lists them all. Patches are scoped to the `with` block and undone on error too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from cudabuild.errors import CompileFailed
from cudabuild.specs import TIMING_SPEC

# The fallbacks ExecuTorch 1.4.1's CUDA runtime provides.
CUDA_SUPPORTED = frozenset({
    "at::_ops::_weight_int4pack_mm::call",
    "at::_ops::sort_stable::call",
    "aoti_torch_cuda_randint_low_out",
    "executorch_cuda::int4_plain_mm", "aoti_torch_cuda_int4_plain_mm",
    "executorch_cuda::int5_plain_mm", "aoti_torch_cuda_int5_plain_mm",
    "executorch_cuda::int6_plain_mm", "aoti_torch_cuda_int6_plain_mm",
    "executorch_cuda::int8_plain_mm", "aoti_torch_cuda_int8_plain_mm",
})


@contextlib.contextmanager
def collect_fallbacks() -> Iterator[set]:
    """Yields the set that fills with every fallback kernel name emitted inside the block."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    seen: set[str] = set()
    shim_call = CppWrapperCpu.generate_c_shim_extern_kernel_call
    runtime_lookup = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_aot

    def recording_shim_call(self, kernel, *args, **kwargs):
        seen.add(str(kernel))
        return shim_call(self, kernel, *args, **kwargs)

    def recording_runtime_lookup(self, op_overload, *args, **kwargs):
        seen.add(getattr(op_overload, "_name", str(op_overload)))
        return runtime_lookup(self, op_overload, *args, **kwargs)

    CppWrapperCpu.generate_c_shim_extern_kernel_call = recording_shim_call
    CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_aot = recording_runtime_lookup
    try:
        yield seen
    finally:
        CppWrapperCpu.generate_c_shim_extern_kernel_call = shim_call
        CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup_aot = runtime_lookup


def unsupported_on_cuda(kernels: set[str]) -> list[str]:
    return sorted(k for k in kernels if k not in CUDA_SUPPORTED)


# ATen's GEMM and convolution kernels, as the C shims name them: what inductor calls for a matmul
# or a convolution when max_autotune=OFF leaves it no Triton template to generate.
_GEMM_OR_CONV = ("mm", "bmm", "addmm", "baddbmm", "addmv", "mv", "convolution", "_convolution", "conv")


def is_gemm_or_conv(kernel: str) -> bool:
    name = kernel.removeprefix("aoti_torch_cuda_").removeprefix("at::_ops::").split("::")[0]
    return name.removesuffix("_out") in _GEMM_OR_CONV


def check_cuda_fallbacks(method: str, kernels: set[str], autotuned: bool = True) -> None:
    """Raise CompileFailed naming every fallback of a cuda compile that the runtime lacks; where
    they are ATen GEMMs or convolutions left by a compile that did not autotune (the spec table's
    TIMING_SPEC OFF), say that this is the cause."""
    missing = unsupported_on_cuda(kernels)
    gemms = [k for k in missing if is_gemm_or_conv(k)]
    if gemms and not autotuned:
        raise CompileFailed(
            f"method {method}: {TIMING_SPEC}=OFF leaves {len(gemms)} ATen GEMM/convolution kernel(s) that "
            f"ExecuTorch's CUDA runtime lacks ({', '.join(gemms)}): with autotuning, inductor generates Triton "
            f"code for them instead; set {method}.{TIMING_SPEC}=ON (or {TIMING_SPEC}=ON)"
        )
    if missing:
        raise CompileFailed(
            f"method {method} needs {len(missing)} fallback kernel(s) the ExecuTorch CUDA runtime lacks: "
            f"{', '.join(missing)}; rewrite those ops or enable triton_kernel_mode"
        )

"""The fallback check of a cuda compile: which ATen kernels the runtime lacks, and why they came."""

from __future__ import annotations

import pytest

from cudabuild.backend.fallbacks import check_cuda_fallbacks, is_gemm_or_conv
from cudabuild.errors import CompileFailed


def test_gemms_and_convolutions_are_told_from_the_other_fallbacks():
    assert [k for k in ("aoti_torch_cuda_mm_out", "aoti_torch_cuda_bmm_out", "aoti_torch_cuda_addmm_out",
                        "aoti_torch_cuda_convolution", "at::_ops::_weight_int4pack_mm::call",
                        "aoti_torch_cuda_randint_low_out", "aoti_torch_cuda_sort_stable") if is_gemm_or_conv(k)] == [
        "aoti_torch_cuda_mm_out", "aoti_torch_cuda_bmm_out", "aoti_torch_cuda_addmm_out", "aoti_torch_cuda_convolution"]


def test_max_autotune_off_is_refused_where_it_leaves_an_aten_gemm_naming_it():
    with pytest.raises(CompileFailed) as err:
        check_cuda_fallbacks("prefill", {"aoti_torch_cuda_mm_out", "at::_ops::_weight_int4pack_mm::call"}, autotuned=False)
    assert str(err.value) == (
        "method prefill: max_autotune=OFF leaves 1 ATen GEMM/convolution kernel(s) that ExecuTorch's CUDA runtime "
        "lacks (aoti_torch_cuda_mm_out): with autotuning, inductor generates Triton code for them instead; "
        "set prefill.max_autotune=ON (or max_autotune=ON)")


def test_a_program_with_only_supported_fallbacks_compiles_with_max_autotune_off():
    check_cuda_fallbacks("decode", {"at::_ops::_weight_int4pack_mm::call", "aoti_torch_cuda_randint_low_out"}, autotuned=False)


def test_other_missing_kernels_are_listed_whatever_the_spec():
    with pytest.raises(CompileFailed, match="needs 1 fallback kernel.*aoti_torch_cuda_topk"):
        check_cuda_fallbacks("decode", {"aoti_torch_cuda_topk"}, autotuned=False)

"""The device memory a stage allocated at most: measured by the stages that use the GPU
(quantize on the device, compile, reference, verify), kept in their values as `peak_gpu_bytes`,
and read by the runner to decide whether two such stages fit on the device together. Backend half.

Most of it is torch's caching allocator's peak. What a stage holds outside it is added where the
stage knows it: torch's AOTI runner puts a .so's constants in one cudaMalloc of the weights blob's
size (AOTInductor's model_base.h, RAII_gpuMalloc), which the allocator never sees: verify's 19 GiB
at 40 layers of Qwen3.5-35B-A3B (`held_outside`)."""

from __future__ import annotations

_outside = 0  # bytes this stage holds on the device outside the allocator, at most, since start()


def start(device: str) -> None:
    """Reset the device's peak counter (cuda only). torch 2.11 refuses to reset it before CUDA is
    initialised ("Invalid device argument"), hence the allocation first."""
    if device != "cuda":
        return
    import torch

    global _outside
    _outside = 0
    torch.zeros(1, device="cuda")
    torch.cuda.reset_peak_memory_stats(0)
    cap_allocator(torch)


def held_outside(nbytes: int) -> None:
    """The stage holds `nbytes` on the device outside the caching allocator (the most at once counts)."""
    global _outside
    _outside = max(_outside, int(nbytes))


def cap_allocator(torch) -> None:
    """Under $CUDABUILD_DEVICE_MEMORY, this process's allocator may not hold more than that: an
    allocation past it fails as it would on a card of that size (cudabuild.engine.workers)."""
    from cudabuild.engine.workers import device_memory_cap

    cap = device_memory_cap()
    if cap is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)


def peak(device: str) -> dict:
    """{"peak_gpu_bytes": the most allocated since start(), with what it held outside the
    allocator} on cuda (and that part as `outside_allocator_bytes`), else {}."""
    if device != "cuda":
        return {}
    import torch

    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(0) + _outside,
            **({"outside_allocator_bytes": _outside} if _outside else {})}

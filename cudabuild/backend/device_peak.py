"""The device memory a stage allocated at most: measured by the stages that use the GPU
(quantize on the device, compile, verify), kept in their values as `peak_gpu_bytes`, and read
by the runner to decide whether two such stages fit on the device together. Backend half."""

from __future__ import annotations


def start(device: str) -> None:
    """Reset the device's peak counter (cuda only). torch 2.11 refuses to reset it before CUDA is
    initialised ("Invalid device argument"), hence the allocation first."""
    if device != "cuda":
        return
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.reset_peak_memory_stats(0)
    cap_allocator(torch)


def cap_allocator(torch) -> None:
    """Under $CUDABUILD_DEVICE_MEMORY, this process's allocator may not hold more than that: an
    allocation past it fails as it would on a card of that size (cudabuild.engine.workers)."""
    from cudabuild.engine.workers import device_memory_cap

    cap = device_memory_cap()
    if cap is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)


def peak(device: str) -> dict:
    """{"peak_gpu_bytes": the most allocated since start()} on cuda, else {}."""
    if device != "cuda":
        return {}
    import torch

    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(0)}

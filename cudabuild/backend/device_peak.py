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


def peak(device: str) -> dict:
    """{"peak_gpu_bytes": the most allocated since start()} on cuda, else {}."""
    if device != "cuda":
        return {}
    import torch

    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(0)}

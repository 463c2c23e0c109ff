"""The custom op libraries a target's programs may call, registered before a program is loaded.

A stored program names its ops; deserializing one that calls an op nobody registered gives a
stand-in that cannot run or lower ("Could not find operator ... Returning fake operator"). On
cuda that is ExecuTorch's Triton op library (`torch.ops.triton.*`: fused MoE, the delta-rule
kernels, sdpa, int4 matvec), which models such as ExecuTorch's Qwen3.5-MoE call directly.
"""

from __future__ import annotations

import functools

LIBRARIES = {"cuda": ("executorch.backends.cuda.triton.kernels",)}


@functools.cache
def register(target: str) -> None:
    import importlib

    for name in LIBRARIES.get(target, ()):
        importlib.import_module(name)

"""The custom op libraries a target's programs may call, registered before a program is loaded,
with the fixes those ops need wherever they run.

A stored program names its ops; deserializing one that calls an op nobody registered gives a
stand-in that cannot run or lower ("Could not find operator ... Returning fake operator"). On
cuda that is ExecuTorch's Triton op library (`torch.ops.triton.*`: fused MoE, the delta-rule
kernels, sdpa, int4 matvec), which models such as ExecuTorch's Qwen3.5-MoE call directly.

Every stage that loads a program registers them here, so a fix applies to every run of an op: the
reference stage's eager run of the exported program included. (It once did not: the delta-rule
fix below was installed only where the model was built, in the export stage, and the reference
stage's eager prefill read `v` scrambled; at the real shapes that failed verify for a right
compiled program. docs/qwen_moe_cuda.md, 2026-12-06.)
"""

from __future__ import annotations

import functools

LIBRARIES = {"cuda": ("executorch.backends.cuda.triton.kernels",)}


@functools.cache
def register(target: str) -> None:
    import importlib

    for name in LIBRARIES.get(target, ()):
        importlib.import_module(name)
    if target == "cuda":
        hand_the_delta_rule_contiguous_tensors()


def hand_the_delta_rule_contiguous_tensors() -> None:
    """Make ExecuTorch's `triton::chunk_gated_delta_rule` op take its tensors contiguous, once per
    process, wherever it runs: eager (verify's reference), under FakeTensors (torch.export), and in
    the decomposition AOTInductor compiles (FunctionalTensorMode).

    ExecuTorch's GatedDeltaNet (prefill) hands the op `v` as a channel slice of the transposed conv
    output: a dense view with strides [T*C, 1, Dv*T, T], not [T*H*Dv, H*Dv, Dv, 1]. The FLA kernels
    behind the op index every input as contiguous [B, T, H, *], so they read v scrambled (and the
    op's `empty_like(v)` outputs are written as contiguous but read with v's strides). Measured on
    the H200 (torch 2.11, executorch 1.4.1, tiny): one delta-rule layer's output off by 4.3 against
    its own 2.7, and 0.016 (bf16 rounding) once v is contiguous; the plain-PyTorch form and a
    token-by-token recurrence agree with the latter. Nothing in the op depends on the torch version,
    so the pairing is not why.

    The op is a `torch.library.triton_op`, whose one Python function is registered three times
    (kernel, fake, functional decomposition); each registration is wrapped in place through the
    op's own `register_*` methods, so the op keeps its name and schema and the exported program
    calls it as the stock one does. A tensor that is contiguous already is passed as it is.
    (Replacing the `torch.ops.triton` attribute instead works eagerly but breaks strict export:
    TorchDynamo treats every attribute of an op namespace as an op.)
    """
    import importlib

    try:  # registered only where fla-core imports (the GPU machine)
        # The module itself: the package's __init__ binds its name to the op.
        kernels = importlib.import_module("executorch.backends.cuda.triton.kernels.chunk_gated_delta_rule")
    except ImportError:
        return
    import torch
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    op = kernels.chunk_gated_delta_rule
    if getattr(op, "hands_contiguous_tensors", False):
        return
    kernel, fake = op._backend_fns[None], op._abstract_fn
    decomposition = op._torch_dispatch_fns[FunctionalTensorMode]

    def dense(values):
        return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in values)

    def decompose(mode, overload, types, args, kwargs):
        with mode:
            args = dense(args)
        return decomposition(mode, overload, types, args, kwargs)

    op.register_kernel(None)(lambda *args, **kwargs: kernel(*dense(args), **kwargs))
    op.register_fake(lambda *args, **kwargs: fake(*dense(args), **kwargs))
    op.register_torch_dispatch(FunctionalTensorMode, decompose)
    op.hands_contiguous_tensors = True

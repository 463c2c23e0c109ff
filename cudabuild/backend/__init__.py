"""The ExecuTorch/CUDA backend: the stage functions (cudabuild.backend.stages) and what they use to
export, lower through AOTInductor, package `.pte` + `.ptd` and verify: inductor options, the CUDA
environment, the low-memory patches, fallbacks, delegates, the stand-in package and tuning.

This is the half that imports torch and executorch (inside functions, when a stage runs).
"""

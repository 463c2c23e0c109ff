"""The toolchain fingerprint: what, besides the model, decides a compiled artifact.

Two levels. `cheap_fingerprint(target)` is computed on every build without importing torch:
package versions from their metadata, the compiler's path and stat, the environment variables
inductor and Triton read, and for cuda the CUDA install's and GPU's identity. It is the probe
stage's key. `probe(target)` runs only when that changes: it imports torch, asks the compiler its
version, and for cuda plans the environment (ptxas, arch list, fatbin) that the compile stage then
applies in a scoped context. Its result feeds the keys of every later stage.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

from cudabuild.engine.graph import Pending
from cudabuild.engine.hashing import stat_signature

# torchao quantizes (and its tensor subclasses lower) ExecuTorch's int4 models; fla-core holds the
# flash-linear-attention kernels ExecuTorch's chunked delta-rule op launches.
PACKAGES = ("torch", "triton", "executorch", "torchao", "fla-core")

# Variables that change what inductor/Triton/AOTI generate (cache dirs are set by cudabuild itself).
ENV_PREFIXES = ("TORCHINDUCTOR_", "TRITON_", "AOT_INDUCTOR_", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")
DEFAULT_INDUCTOR_DIR = "/tmp/cudabuild-inductor"


def inductor_root() -> str:
    """Where compiles get their private inductor dirs. The path ends up inside every .so, so it
    is part of the toolchain: the same absolute path everywhere gives the same bytes everywhere."""
    return os.environ.get("CUDABUILD_INDUCTOR_DIR") or DEFAULT_INDUCTOR_DIR
ENV_IGNORED = {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST",
               "TORCHINDUCTOR_REDIS_PORT", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"}


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler_path() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def relevant_env(environ=os.environ) -> dict:
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED}


def cheap_fingerprint(target: str) -> dict:
    cxx = compiler_path()
    fp = {
        "target": target,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "compiler": {"path": cxx, "stat": stat_signature(os.path.realpath(cxx)) if cxx else None},
        "env": relevant_env(),
        "inductor_root": inductor_root(),
    }
    if target == "cuda":
        from cudabuild.backend.cuda_env import cheap_cuda_fingerprint

        fp["cuda"] = cheap_cuda_fingerprint(os.environ)
    return fp


# Cheap-fingerprint fields that hold on this machine only (a file's inode and mtime, the GPUs' bus
# addresses, which devices this process sees): machines sharing keys need not agree on them.
_MACHINE_LOCAL = {("compiler", "stat"), ("cuda", "installs"), ("cuda", "path_tools"), ("cuda", "gpus"),
                  ("cuda", "device_nodes"), ("cuda", "env", "CUDA_VISIBLE_DEVICES"), ("cuda", "env", "CUDA_DEVICE_ORDER")}


def fingerprint_difference(here: dict, there: dict) -> str | None:
    """The first field where two cheap fingerprints differ in what decides a build (package
    versions, python, the inductor/Triton environment, ...), as "FIELD: THERE here HERE"; None when
    they agree. A cluster's worker builds under its driver's fingerprint, and checks it so."""

    def walk(a, b, path):
        if path in _MACHINE_LOCAL:
            return None
        if isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                if (found := walk(a.get(name), b.get(name), path + (name,))) is not None:
                    return found
            return None
        return None if a == b else f"{'.'.join(path)}: {b!r} there, {a!r} here"

    return walk(here, there, ())


def _compiler_version(cxx: str | None) -> str | None:
    if not cxx:
        return None
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def probe(target: str) -> dict:
    """The full toolchain description (imports torch). Every field is JSON data."""
    import torch

    result = {
        "target": target,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "executorch": package_version("executorch"),
        "torchao": package_version("torchao"),
        "fla-core": package_version("fla-core"),
        "compiler": _compiler_version(compiler_path()),
        "env": relevant_env(),
        "inductor_root": inductor_root(),
    }
    if target == "cuda":
        result["cuda"] = _probe_cuda(torch)
    pairing = unsupported_pairing("executorch", "torch", torch.__version__)
    if pairing:
        from cudabuild.engine.console import terminal

        terminal.warn(pairing)
        result["notes"] = [pairing]
    return result


def unsupported_pairing(package: str, requirement: str, installed: str | None) -> str | None:
    """One line when `package` declares a range for `requirement` that the installed version is
    outside of, else None. A failure seen only with such a pairing may come from it."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        declared = importlib.metadata.requires(package) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in declared:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name != requirement or req.marker is not None or not req.specifier or installed is None:
            continue
        try:
            version = Version(installed)
        except InvalidVersion:
            return None
        # A local build tag (+cu130) is not part of the release the range speaks of.
        if not req.specifier.contains(Version(version.public), prereleases=True):
            return (f"{package} {package_version(package)} declares {requirement}{req.specifier}, and this is "
                    f"{requirement} {installed}: a failure seen only here may come from that pairing")
    return None


def _probe_cuda(torch) -> dict:
    from cudabuild.backend import cuda_env
    from cudabuild.errors import NoGpu

    if not torch.cuda.is_available():
        raise NoGpu("target=cuda needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False); use target=cpu")
    if torch.version.cuda is None:
        raise NoGpu(f"target=cuda needs a CUDA build of torch; this one is {torch.__version__}")
    capability = torch.cuda.get_device_capability(0)
    try:
        from torch.utils.cpp_extension import CUDA_HOME as torch_cuda_home
    except Exception:
        torch_cuda_home = None
    environ = dict(os.environ)
    plan = cuda_env.plan_cuda_env(
        torch.version.cuda, capability, environ,
        ptxas_finder=lambda v: cuda_env.find_ptxas(v, torch_cuda_home=torch_cuda_home, environ=environ),
    )
    return {
        "cuda_version": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "capability": list(capability),
        "emit_multi_arch_kernel": plan.emit_multi_arch_kernel,
        "env": dict(sorted(plan.env.items())),
        "notes": list(plan.notes),
    }


def resolve_target(target: str, environ=os.environ) -> tuple[str, str | None]:
    """(target, note): `auto` becomes cuda when a GPU is visible, else cpu, and says which."""
    from cudabuild.errors import UnknownTarget

    if target in ("cpu", "cuda"):
        return target, None
    if target != "auto":
        raise UnknownTarget(f"unknown target '{target}'; expected auto, cpu or cuda")
    from cudabuild.backend.cuda_env import gpu_present

    if gpu_present(environ):
        return "cuda", "target=auto: a GPU is present, so target=cuda"
    return "cpu", "target=auto: no GPU found, so target=cpu"


def require_device(target: str, environ=os.environ) -> None:
    """A build for cuda on a machine that shows no GPU stops before any stage: the probe would find
    out only after importing torch, and leave build/ behind. No torch here."""
    from cudabuild.backend.cuda_env import gpu_present
    from cudabuild.errors import NoGpu

    if target == "cuda" and not gpu_present(environ):
        raise NoGpu("target=cuda", "this machine shows no NVIDIA GPU (no /dev/nvidia*, or CUDA_VISIBLE_DEVICES hides them)",
                    fix="build with target=cpu, or target=auto to pick what is here")


def python_executable() -> str:
    return sys.executable


# -- what explain predicts probe will report -----------------------------------------------------

# Probe fields the cheap fingerprint determines exactly (probe computes them the same way).
_EXACT = {"target": ("target",), "python": ("python",), "machine": ("machine",), "env": ("env",),
          "triton": ("packages", "triton"), "executorch": ("packages", "executorch"),
          "torchao": ("packages", "torchao"), "fla-core": ("packages", "fla-core"),
          "inductor_root": ("inductor_root",)}
# Fields that only some toolchains report (a note about the torch/executorch pairing): unchanged
# when the fingerprint is, otherwise unknown.
# Fields probe measures itself: unchanged when their fingerprint source is, otherwise unknown.
_MEASURED = {"torch": ("packages", "torch"), "compiler": ("compiler",), "cuda": ("cuda",),
             "notes": ("packages",)}
_MISSING = object()


def _at(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree.get(key, _MISSING) if isinstance(tree, dict) else _MISSING
    return tree


def predict_probe_value(old_stamp_value: dict | None, old_fingerprint: dict | None, fingerprint: dict) -> dict:
    """What probe will report, from the new cheap fingerprint and its last report (with the
    fingerprint that report was made for); Pending where it cannot be known without running."""
    old_value = old_stamp_value or {}
    old_fp = old_fingerprint or {}
    value = {field: _at(fingerprint, path) for field, path in _EXACT.items()}
    for field, path in _MEASURED.items():
        if field == "cuda" and fingerprint.get("target") != "cuda":
            continue
        if field == "notes" and "notes" not in old_value:
            continue
        same = old_stamp_value is not None and field in old_value and _at(old_fp, path) == _at(fingerprint, path)
        value[field] = old_value[field] if same else Pending("probe")
    return value

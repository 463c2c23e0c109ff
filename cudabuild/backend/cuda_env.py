"""CUDA toolchain probing for the CUDA target, as pure functions over explicit inputs.

Owns: parsing torch's CUDA version, finding a ptxas that belongs to that version, planning the
environment variables a multi-arch (fatbin) AOTInductor compile needs, applying such a plan inside
a scope, and a cheap fingerprint of everything the probe reads, for the probe's up-to-date check.

Must not touch: torch. The no-op build path imports this module, so it stays torch-free; whatever
torch knows (its CUDA version, its CUDA_HOME, the device capability) is passed in by the caller.
Nothing here writes os.environ except `scoped_environ`, which undoes its writes on exit.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, MutableMapping, Optional, Union

CudaVersion = Union[str, tuple[int, int]]

# Below this CUDA version the compile needs TORCH_CUDA_ARCH_LIST pinned to the device, and from
# PTXAS_PINNED_FROM on also a ptxas of the same version, to emit a multi-arch kernel.
MULTI_ARCH_NATIVE_FROM = (12, 9)
PTXAS_PINNED_FROM = (12, 6)

FINGERPRINT_ENV_VARS = (
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_ROOT",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "TORCH_CUDA_ARCH_LIST",
    "TRITON_PTXAS_PATH",
)
FINGERPRINT_ENV_PREFIXES = ("TORCHINDUCTOR_", "TRITON_")
# Files whose identity stands for a CUDA install: any of them changing may change the probe.
INSTALL_IDENTITY_FILES = ("version.json", "bin/nvcc", "bin/ptxas")


def parse_cuda_version(text: str) -> tuple[int, int]:
    """`"12.8"` -> `(12, 8)`; a patch component (`"12.8.1"`) is ignored."""
    parts = str(text).strip().split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(
            f"CUDA version {text!r} is not of the form MAJOR.MINOR (e.g. '12.8')"
        ) from None
    return major, minor


def _version_tuple(version: CudaVersion) -> tuple[int, int]:
    if isinstance(version, tuple):
        return int(version[0]), int(version[1])
    return parse_cuda_version(version)


def _belongs_to_version(ptxas: str, marker: str) -> bool:
    return os.path.exists(ptxas) and marker in os.path.realpath(ptxas)


def find_ptxas(
    cuda_version: CudaVersion,
    *,
    torch_cuda_home: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
    versioned_prefix: str = "/usr/local",
) -> Optional[str]:
    """The first ptxas of CUDA `cuda_version` in the reference's search order, or None.

    Order: `<torch_cuda_home>/bin/ptxas`; `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT` (each
    `/bin/ptxas`); `<versioned_prefix>/cuda-X.Y/bin/ptxas`; `ptxas` on `environ["PATH"]`;
    `<versioned_prefix>/cuda/bin/ptxas`. A candidate counts only if its real path (links
    resolved) contains `/cuda-X.Y/`, except the versioned path, which counts if it exists.
    `environ` defaults to os.environ; a missing PATH skips the PATH step.
    """
    major, minor = _version_tuple(cuda_version)
    marker = f"/cuda-{major}.{minor}/"
    environ = os.environ if environ is None else environ

    homes = [torch_cuda_home] + [environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    for home in homes:
        if home:
            candidate = os.path.join(home, "bin", "ptxas")
            if _belongs_to_version(candidate, marker):
                return candidate

    versioned = os.path.join(versioned_prefix, f"cuda-{major}.{minor}", "bin", "ptxas")
    if os.path.exists(versioned):
        return versioned

    search_path = environ.get("PATH")
    if search_path:
        on_path = shutil.which("ptxas", path=search_path)
        if on_path and _belongs_to_version(on_path, marker):
            return on_path

    default = os.path.join(versioned_prefix, "cuda", "bin", "ptxas")
    if _belongs_to_version(default, marker):
        return default
    return None


@dataclass(frozen=True)
class CudaEnvPlan:
    """What a CUDA compile should run under.

    `emit_multi_arch_kernel` is the value for `aot_inductor.emit_multi_arch_kernel`; `env` holds
    the variables to set for the compile (apply with `scoped_environ(plan.env)`); `notes` says
    why, one line each, for logs and reports.
    """

    emit_multi_arch_kernel: bool
    env: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "notes", tuple(self.notes))

    def to_json(self) -> dict:
        """Plain data for a cache key or a record."""
        return {
            "emit_multi_arch_kernel": self.emit_multi_arch_kernel,
            "env": dict(sorted(self.env.items())),
            "notes": list(self.notes),
        }


def plan_cuda_env(
    cuda_version: Optional[CudaVersion],
    capability: Optional[tuple[int, int]],
    environ: Mapping[str, str],
    ptxas_finder: Optional[Callable[[str], Optional[str]]] = None,
) -> CudaEnvPlan:
    """Plan the fatbin environment the reference sets up, without touching os.environ.

    `cuda_version` is torch's (`torch.version.cuda`, None for a CPU build); `capability` is the
    device's `(major, minor)`, None when no device is visible; `environ` is the environment the
    compile would otherwise run under. `ptxas_finder(version)` is asked only for CUDA 12.6-12.8;
    it defaults to `find_ptxas(version, environ=environ)` (no torch CUDA_HOME: pass a finder
    bound to it from the caller that has torch).
    """
    if cuda_version is None:
        return CudaEnvPlan(False, {}, ("torch has no CUDA: multi-arch kernels off",))
    major, minor = _version_tuple(cuda_version)
    version = f"{major}.{minor}"
    if (major, minor) >= MULTI_ARCH_NATIVE_FROM:
        return CudaEnvPlan(
            True, {}, (f"CUDA {version} emits multi-arch kernels natively: nothing to set",)
        )

    env: dict[str, str] = {}
    notes: list[str] = []
    if (major, minor) >= PTXAS_PINNED_FROM:
        finder = ptxas_finder or (lambda v: find_ptxas(v, environ=environ))
        ptxas = finder(version)
        if ptxas is None:
            notes.append(
                f"no ptxas of CUDA {version} found (torch CUDA_HOME, $CUDA_HOME/$CUDA_PATH/"
                f"$CUDA_ROOT, cuda-{version}, PATH, cuda): multi-arch kernels off"
            )
            return CudaEnvPlan(False, {}, notes)
        env["TRITON_PTXAS_PATH"] = ptxas
        previous = environ.get("TRITON_PTXAS_PATH")
        if previous is not None and previous != ptxas:
            notes.append(f"TRITON_PTXAS_PATH={ptxas} replaces the user's {previous}")
        else:
            notes.append(f"TRITON_PTXAS_PATH={ptxas} (ptxas of CUDA {version})")

    user_arch_list = environ.get("TORCH_CUDA_ARCH_LIST")
    if user_arch_list is not None:
        notes.append(
            f"TORCH_CUDA_ARCH_LIST={user_arch_list!r} set by the user: kept, the device's "
            "capability is not used"
        )
        return CudaEnvPlan(True, env, notes)
    if capability is None:
        # The reference fails here after it has already exported TRITON_PTXAS_PATH; keep that.
        notes.append("no device capability to pin TORCH_CUDA_ARCH_LIST: multi-arch kernels off")
        return CudaEnvPlan(False, env, notes)
    env["TORCH_CUDA_ARCH_LIST"] = f"{capability[0]}.{capability[1]}"
    notes.append(f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} (device capability)")
    return CudaEnvPlan(True, env, notes)


@contextlib.contextmanager
def scoped_environ(
    updates: Mapping[str, Optional[str]],
    *,
    environ: Optional[MutableMapping[str, str]] = None,
) -> Iterator[None]:
    """Set `updates` (a None value unsets) for the duration of the block, then restore.

    On exit, normal or not, each touched variable gets its previous value back, and one that was
    absent is removed again. `environ` defaults to os.environ.
    """
    environ = os.environ if environ is None else environ
    saved = {name: environ.get(name) for name in updates}
    try:
        for name, value in updates.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value


def _file_identity(path: str) -> Optional[dict]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"realpath": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _install_identity(root: str) -> dict:
    files = {rel: _file_identity(os.path.join(root, rel)) for rel in INSTALL_IDENTITY_FILES}
    return {"realpath": os.path.realpath(root), "files": files}


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _torch_version_file() -> Optional[dict]:
    # find_spec locates the package without executing it: torch's own version.py records its
    # CUDA version, so a torch upgrade shows here without importing torch.
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return _file_identity(os.path.join(list(spec.submodule_search_locations)[0], "version.py"))


def cheap_cuda_fingerprint(
    environ: Optional[Mapping[str, str]] = None,
    *,
    prefix: str = "/usr/local",
    proc_root: str = "/proc",
    dev_root: str = "/dev",
) -> dict:
    """Everything the CUDA probe depends on, read in milliseconds without torch.

    Fields (all JSON-serialisable): `env` (the CUDA/arch/ptxas variables and every
    TORCHINDUCTOR_*/TRITON_* one), `installs` (real path and (size, mtime_ns) of version.json,
    bin/nvcc and bin/ptxas under `<prefix>/cuda`, each `<prefix>/cuda-X.Y` and the env homes),
    `path_tools` (the nvcc/ptxas found on PATH), `torch_version_py`, `driver` and `gpus` (the
    NVIDIA driver's proc files) and `device_nodes` (the /dev/nvidia* names).
    """
    environ = os.environ if environ is None else environ
    env = {
        name: value
        for name, value in environ.items()
        if name in FINGERPRINT_ENV_VARS or name.startswith(FINGERPRINT_ENV_PREFIXES)
    }

    roots = [os.path.join(prefix, "cuda")] + sorted(glob.glob(os.path.join(prefix, "cuda-*")))
    roots += [environ[v] for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT") if environ.get(v)]
    installs = {root: _install_identity(root) for root in dict.fromkeys(roots)}

    search_path = environ.get("PATH")
    path_tools = {}
    for tool in ("nvcc", "ptxas"):
        found = shutil.which(tool, path=search_path) if search_path else None
        path_tools[tool] = _file_identity(found) if found else None

    gpu_dirs = sorted(glob.glob(os.path.join(proc_root, "driver", "nvidia", "gpus", "*")))
    gpus = {
        os.path.basename(d): _read_text(os.path.join(d, "information")) for d in gpu_dirs
    }
    return {
        "env": dict(sorted(env.items())),
        "installs": installs,
        "path_tools": path_tools,
        "torch_version_py": _torch_version_file(),
        "driver": _read_text(os.path.join(proc_root, "driver", "nvidia", "version")),
        "gpus": gpus,
        "device_nodes": _nvidia_device_nodes(dev_root),
    }


def _nvidia_device_nodes(dev_root: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(dev_root, "nvidia*")))


def _visible_devices_hide_all(environ: Mapping[str, str]) -> bool:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return False
    first = value.split(",")[0].strip()
    # CUDA stops at the first invalid entry, so an empty list or a leading -1 hides every device.
    return first in ("", "-1")


def gpu_present(
    environ: Optional[Mapping[str, str]] = None,
    *,
    proc_root: str = "/proc",
    dev_root: str = "/dev",
) -> bool:
    """Best guess, without torch, whether a CUDA device is usable here (for `target=auto`).

    False when CUDA_VISIBLE_DEVICES hides every device; otherwise True when the NVIDIA driver
    lists a GPU under `<proc_root>/driver/nvidia/gpus` or a `<dev_root>/nvidiaN` node exists.
    """
    environ = os.environ if environ is None else environ
    if _visible_devices_hide_all(environ):
        return False
    if glob.glob(os.path.join(proc_root, "driver", "nvidia", "gpus", "*")):
        return True
    return any(name[len("nvidia"):].isdigit() for name in _nvidia_device_nodes(dev_root))


def visible_gpus(
    environ: Optional[Mapping[str, str]] = None,
    *,
    proc_root: str = "/proc",
    dev_root: str = "/dev",
) -> list[str]:
    """The GPUs a process here may use, as CUDA_VISIBLE_DEVICES entries, without torch: that
    variable's list when it is set (up to an entry that hides the rest), else one index per GPU the
    driver lists (or /dev/nvidiaN node). What `cluster=local` starts one GPU worker for."""
    environ = os.environ if environ is None else environ
    if not gpu_present(environ, proc_root=proc_root, dev_root=dev_root):
        return []
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        listed = []
        for entry in (e.strip() for e in value.split(",")):
            if entry in ("", "-1"):
                break
            listed.append(entry)
        return listed
    count = len(glob.glob(os.path.join(proc_root, "driver", "nvidia", "gpus", "*")))
    count = count or sum(1 for name in _nvidia_device_nodes(dev_root) if name[len("nvidia"):].isdigit())
    return [str(i) for i in range(count)]

"""Compile specs: the table of accepted keys and values, per-target defaults, and merging.

A spec is a backend knob that ends up in the .pte (all specs are serialized with the delegate)
and in the keys of the stages it affects. Values are merged once, in this order (later wins):
table default for the target, recipe specs for all targets, recipe specs for the target, the
method's own recipe specs, command-line `KEY=VALUE`, command-line `METHOD.KEY=VALUE`.
Errors are collected and reported together on one line. No torch here.

The table is the one place a spec is named and given its defaults: what inductor option it sets
(`inductor`), whether it decides the autotune decisions a compile makes (`tuning`), and whether ON
tunes kernels by timing them (`times_kernels`: a CPU compile then runs alone, and on cuda OFF leaves
inductor ATen GEMMs the runtime lacks) are columns of its row, asked through the functions below,
so the backend walks from a spec to inductor in one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from cudabuild.errors import InvalidSpec, compose

ON_OFF = ("ON", "OFF")


@dataclass(frozen=True)
class SpecKey:
    allowed: Optional[tuple[str, ...]]  # None: any string
    cpu: Optional[str]  # default for target cpu (None: unset)
    cuda: Optional[str]
    stages: tuple[str, ...]  # stages whose result depends on it (package always does)
    doc: str
    # Whether the .pte carries it as one of the delegate's compile specs (the CUDA backend's own
    # keys); inductor settings cudabuild applies around the compile are keyed, not serialized.
    serialized: bool = True
    inductor: Optional[str] = None  # the inductor option an ON/OFF spec sets (ON: True)
    tuning: bool = False  # decides which autotune decisions a compile makes (their stored key)
    times_kernels: bool = False  # ON: kernels are tuned by timing them


SPEC_TABLE: dict[str, SpecKey] = {
    "triton_kernel_mode": SpecKey(ON_OFF, "OFF", "ON", ("edge", "compile"), "replace sdpa/topk with ExecuTorch's Triton kernels"),
    "low_memory_mode": SpecKey(ON_OFF, "OFF", "OFF", ("compile",), "free KV-cache storage and clone mutated buffers on the CPU during compile"),
    "emulate_precision_casts": SpecKey(ON_OFF, "ON", "ON", ("compile",), "inductor emulates eager's low-precision casts",
                                       inductor="emulate_precision_casts"),
    "max_autotune": SpecKey(ON_OFF, "OFF", "ON", ("compile",), "tune GEMM/pointwise kernels by benchmarking",
                            inductor="max_autotune", tuning=True, times_kernels=True),
    "autotune_at_compile_time": SpecKey(ON_OFF, None, None, ("compile",), "tune Triton kernels while compiling, not at first run",
                                        inductor="triton.autotune_at_compile_time", tuning=True),
    "autotune_pointwise": SpecKey(ON_OFF, None, None, ("compile",), "tune pointwise kernels too",
                                  inductor="triton.autotune_pointwise", tuning=True),
    "platform": SpecKey(("linux", "windows"), "linux", "linux", ("compile",), "platform the .so is built for"),
    "shim_library_path": SpecKey(None, None, None, ("compile",), "folder of aoti_cuda_shims (windows only)"),
    "compile_wrapper_opt_level": SpecKey(("O0", "O1", "O2", "O3", "Os"), None, None, ("compile",),
                                         "the C++ compiler's -O for the generated wrapper (unset: inductor's O1)",
                                         serialized=False),
    "coordinate_descent_tuning": SpecKey(ON_OFF, None, None, ("compile",),
                                         "inductor's coordinate-descent tuning of Triton kernel configs", serialized=False,
                                         inductor="coordinate_descent_tuning"),
}
# The spec that tunes kernels by timing them, by its name (messages name it).
TIMING_SPEC = next(name for name, spec in SPEC_TABLE.items() if spec.times_kernels)

TARGETS = ("cpu", "cuda")


def normalize(key: str, value: str) -> str:
    """The value as the table spells it (values are case-insensitive: on, On and ON are ON)."""
    spec = SPEC_TABLE[key]
    if spec.allowed is not None:
        fallback = str(value).upper() if spec.allowed == ON_OFF else str(value)  # shown so in its error
        return next((a for a in spec.allowed if a.lower() == str(value).lower()), fallback)
    return str(value)


def serialized(specs: Mapping[str, str]) -> dict[str, str]:
    """The specs a .pte carries as its delegate's compile specs."""
    return {k: v for k, v in specs.items() if SPEC_TABLE[k].serialized}


def _problems(key: str, value: str, target: str, where: str) -> list[str]:
    if key not in SPEC_TABLE:
        return [compose(f"unknown spec '{key}' ({where})", fix=f"known: {', '.join(sorted(SPEC_TABLE))}")]
    spec = SPEC_TABLE[key]
    value = normalize(key, value)
    if spec.allowed is not None and value not in spec.allowed:
        return [compose(f"invalid value {key}={value} ({where})", fix=f"expected {' or '.join(spec.allowed)}")]
    return []


def resolve_method_specs(*args) -> dict[str, dict[str, str]]:
    """merge_method_specs(...)'s merged specs; its problems raised together as one InvalidSpec."""
    merged, problems = merge_method_specs(*args)
    if problems:
        raise InvalidSpec("; ".join(problems))
    return merged


def merge_method_specs(
    target: str,
    methods: list[str],
    recipe_specs: Mapping[str, Mapping[str, str]],
    method_specs: Mapping[str, Mapping[str, Mapping[str, str]]],
    overrides: Mapping[str, str],
) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Merge specs for each method and validate them all: (merged, every problem, one line each).

    `recipe_specs` is {target|"all": {key: value}}, `method_specs` is {method: {target|"all": {...}}},
    `overrides` is the command line's {"key": v, "method.key": v}.
    """
    problems: list[str] = []
    merged: dict[str, dict[str, str]] = {}
    broken_rules: dict[str, list[str]] = {}  # a target rule's message -> the methods that break it
    for name, raw in overrides.items():
        method, _, key = name.rpartition(".")
        if method and method not in methods:
            problems.append(f"spec override '{name}' names unknown method '{method}'; methods: {', '.join(methods)}")
    for method in methods:
        layers = [
            ("default", {k: v for k, v in ((k, getattr(s, target)) for k, s in SPEC_TABLE.items()) if v is not None}),
            ("recipe", recipe_specs.get("all", {})),
            ("recipe", recipe_specs.get(target, {})),
            (f"recipe method {method}", method_specs.get(method, {}).get("all", {})),
            (f"recipe method {method}", method_specs.get(method, {}).get(target, {})),
            ("command line", {k: v for k, v in overrides.items() if "." not in k}),
            ("command line", {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith(method + ".")}),
        ]
        specs: dict[str, str] = {}
        for where, layer in layers:
            for key, value in layer.items():
                found = _problems(key, value, target, where)
                if found:
                    problems.extend(p for p in found if p not in problems)
                    continue
                specs[key] = normalize(key, value)
        for rule in _target_rules(specs, target):
            broken_rules.setdefault(rule, []).append(method)
        merged[method] = dict(sorted(specs.items()))
    # One line per broken rule, naming every method that breaks it (one mistake, one line).
    for rule, names in broken_rules.items():
        problems.append(rule.format(where=f"method {names[0]}" if len(names) == 1 else f"methods {', '.join(names)}"))
    return merged, problems


def _target_rules(specs: Mapping[str, str], target: str) -> list[str]:
    """The target's rules these specs break, each a message with `{where}` for the methods."""
    found = []
    if target == "cpu" and specs.get("triton_kernel_mode") == "ON":
        found.append("triton_kernel_mode=ON needs target=cuda ({where}): ExecuTorch's Triton kernels take CUDA tensors only")
    if target == "cpu" and specs.get("platform") == "windows":
        found.append("platform=windows needs target=cuda ({where})")
    # max_autotune=OFF on cuda is judged by the program, not here: without autotuning inductor
    # calls ATen for a GEMM or a convolution, which the runtime lacks, but a program whose matmuls
    # are int4 or Triton ops has none (ExecuTorch's Qwen3.5-MoE). The compile's fallback check
    # refuses it where it finds one, naming it (cudabuild.backend.fallbacks).
    if "shim_library_path" in specs and specs.get("platform") != "windows":
        found.append("shim_library_path is for platform=windows only ({where})")
    return found


def inductor_options(specs: Mapping[str, str]) -> dict[str, bool]:
    """{inductor option: bool} the ON/OFF specs given set."""
    return {SPEC_TABLE[k].inductor: v == "ON" for k, v in specs.items() if SPEC_TABLE[k].inductor}


def tuning_specs(specs: Mapping[str, str]) -> dict[str, str]:
    """The specs that decide which autotune decisions a compile makes."""
    return {k: v for k, v in specs.items() if SPEC_TABLE[k].tuning}


def times_kernels(specs: Mapping[str, str], target: str) -> bool:
    """Whether a compile with these specs tunes kernels by timing them (a spec left out: the
    target's default)."""
    return any((specs.get(k) or getattr(s, target)) == "ON" for k, s in SPEC_TABLE.items() if s.times_kernels)


def compile_keeps_weights_on_host(specs: Mapping[str, str], target: str) -> bool:
    """Whether a compile leaves the program's weights off the device (cudabuild.backend.lowmem):
    with low_memory_mode=ON on a device, unless Triton's tuning runs the program itself
    (autotune_at_compile_time=OFF: inductor's first pass runs it on its real weights). Unset, that
    spec is torch's default for AOTInductor: tuning at compile time, on example values."""
    return target != "cpu" and specs.get("low_memory_mode") == "ON" and specs.get("autotune_at_compile_time") != "OFF"


def specs_for_stage(specs: Mapping[str, str], stage: str) -> dict[str, str]:
    """The subset of a method's specs that decides the given stage's output."""
    return {k: v for k, v in specs.items() if stage in SPEC_TABLE[k].stages}

"""Spec validation, merging order, and which stage keys each spec enters (no torch, no builds)."""

from __future__ import annotations

import pytest

from cudabuild.config import BuildConfig
from cudabuild.errors import InvalidSpec
from cudabuild.engine.graph import Result, Stage
from cudabuild.pipeline import PIPELINE
from cudabuild.engine.hashing import digest
from cudabuild.specs import resolve_method_specs, serialized, specs_for_stage

METHODS = ["decode", "prefill"]


def resolve(target="cuda", recipe=None, method_specs=None, overrides=None):
    return resolve_method_specs(target, METHODS, recipe or {}, method_specs or {}, overrides or {})


def test_defaults_per_target():
    assert resolve("cuda")["decode"]["triton_kernel_mode"] == "ON"
    assert resolve("cpu")["decode"]["triton_kernel_mode"] == "OFF"
    assert resolve("cuda")["decode"]["max_autotune"] == "ON"


def test_merge_order_recipe_then_method_then_command_line():
    specs = resolve(
        "cuda",
        recipe={"all": {"max_autotune": "OFF"}, "cuda": {"low_memory_mode": "ON"}},
        method_specs={"decode": {"cuda": {"low_memory_mode": "OFF"}}},
        overrides={"max_autotune": "on", "prefill.emulate_precision_casts": "off"},
    )
    assert specs["decode"]["low_memory_mode"] == "OFF" and specs["prefill"]["low_memory_mode"] == "ON"
    assert specs["decode"]["max_autotune"] == specs["prefill"]["max_autotune"] == "ON"  # normalized case
    assert specs["prefill"]["emulate_precision_casts"] == "OFF" and specs["decode"]["emulate_precision_casts"] == "ON"


def test_every_problem_reported_at_once():
    with pytest.raises(InvalidSpec) as err:
        resolve("cpu", overrides={"max_autotune": "maybe", "bogus": "ON", "triton_kernel_mode": "ON", "nomethod.max_autotune": "ON"})
    message = str(err.value)
    assert "\n" not in message
    for part in ("invalid value max_autotune=MAYBE", "unknown spec 'bogus'", "triton_kernel_mode=ON needs target=cuda",
                 "unknown method 'nomethod'"):
        assert part in message


def test_shim_library_path_only_for_windows():
    with pytest.raises(InvalidSpec, match="platform=windows only"):
        resolve("cuda", overrides={"shim_library_path": "/x"})
    assert resolve("cuda", overrides={"platform": "windows", "shim_library_path": "/x"})["decode"]["platform"] == "windows"


def test_max_autotune_off_is_a_valid_cuda_spec_judged_by_the_program():
    # ExecuTorch's Qwen3.5-MoE is built with max_autotune=OFF: its int4 and Triton ops leave no
    # ATen GEMM. Where one is left, the compile's fallback check refuses it (tests/test_fallbacks.py).
    merged = resolve("cuda", overrides={"decode.max_autotune": "off"})
    assert merged["decode"]["max_autotune"] == "OFF" and merged["prefill"]["max_autotune"] == "ON"


def test_inductor_settings_are_keyed_but_not_serialized_into_the_pte():
    merged = resolve("cuda", overrides={"compile_wrapper_opt_level": "o0", "coordinate_descent_tuning": "off"})
    assert merged["decode"]["compile_wrapper_opt_level"] == "O0"
    assert specs_for_stage(merged["decode"], "compile")["coordinate_descent_tuning"] == "OFF"
    assert "compile_wrapper_opt_level" not in serialized(merged["decode"])
    assert serialized(merged["decode"])["max_autotune"] == "ON"
    with pytest.raises(InvalidSpec, match="expected O0 or O1 or O2 or O3 or Os"):
        resolve("cuda", overrides={"compile_wrapper_opt_level": "O9"})


def _config(specs):
    description = {"methods": METHODS, "sources": {"recipes/m.py": "a" * 64}, "options": {}, "specs": {}, "method_specs": {}}
    from pathlib import Path

    return BuildConfig(Path("/nonexistent"), "m", "cuda", {}, specs, description)


def _keys(specs):
    config = _config(specs)
    stamps = {"probe": Result("p", {"torch": "2.13", "executorch": "1.4.1", "triton": "3.6"}),
              "export.decode": Result("e1"), "export.prefill": Result("e2"),
              "edge.decode": Result("g1"), "edge.prefill": Result("g2"),
              "compile.decode": Result("c1"), "compile.prefill": Result("c2")}
    read = lambda stage: stamps.get(stage.id)
    stages = [Stage("export", "decode"), Stage("edge", "decode"), Stage("compile", "decode"), Stage("compile", "prefill"), Stage("package")]
    return {s.id: digest(PIPELINE.inputs(s, config, read, lambda: {}, lambda: None)) for s in stages}


def test_a_compile_spec_enters_that_methods_compile_and_package_keys_only():
    base = resolve("cuda")
    changed = {**base, "decode": {**base["decode"], "max_autotune": "OFF"}}
    before, after = _keys(base), _keys(changed)
    assert {k for k in before if before[k] != after[k]} == {"compile.decode", "package"}


def test_triton_kernel_mode_enters_the_edge_key():
    base = resolve("cuda")
    changed = {**base, "decode": {**base["decode"], "triton_kernel_mode": "OFF"}}
    before, after = _keys(base), _keys(changed)
    assert {k for k in before if before[k] != after[k]} == {"edge.decode", "compile.decode", "package"}
    assert specs_for_stage(base["decode"], "edge") == {"triton_kernel_mode": "ON"}

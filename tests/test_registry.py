"""Tests for cudabuild/registry.py: a recipe's sources are its file and the project modules it
imports, so an edit of the model a recipe builds (cudabuild/models/...) is a source change."""

from __future__ import annotations

import pytest

from cudabuild import registry
from cudabuild.engine.store import Store


@pytest.mark.parametrize("model, modules", [
    ("tiny_lm", ["cudabuild/models/tiny_lm.py"]),
    ("qwen_moe", ["cudabuild/models/qwen35_moe.py", "cudabuild/models/qwen35_moe_plain.py",
                  "cudabuild/models/qwen35_moe_cuda.py", "cudabuild/models/qwen35_moe_weights.py",
                  "cudabuild/models/qwen35_moe_quantize.py", "cudabuild/models/qwen35_moe_sizes.py",
                  "cudabuild/models/qwen_moe_checkpoint.py", "cudabuild/formats/safetensors_parts.py"]),
])
def test_the_model_modules_a_recipe_imports_are_its_sources(project, model, modules):
    sources = [str(p.relative_to(project.root)) for p in registry.source_files(project.root, model)]
    assert f"recipes/{model}.py" in sources
    assert set(modules) <= set(sources), sources


@pytest.mark.parametrize("model, edited", [
    ("tiny_lm", "cudabuild/models/tiny_lm.py"),
    ("qwen_moe", "cudabuild/models/qwen35_moe_plain.py"),
])
def test_editing_a_model_module_changes_the_described_sources(project, model, edited):
    store = Store(project.cache)
    try:
        before = registry.describe(project.root, model, store, "cpu")["sources"]
        path = project.root / edited
        path.write_text(path.read_text() + "\n# a comment: no edit of the code\n")
        commented = registry.describe(project.root, model, store, "cpu")["sources"]
        path.write_text(path.read_text() + "\nAN_EDIT = 1\n")
        after = registry.describe(project.root, model, store, "cpu")["sources"]
    finally:
        store.close()
    assert commented == before
    assert {name for name in before if before[name] != after[name]} == {edited}

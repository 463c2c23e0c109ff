"""The quantize stage's `layout` facet (cudabuild.backend.stages.quantize): its prepared weights
without their values, what the trace stage keys on, so that new weights of the same layout (another
seed's bundle) trace nothing, and a bundle of other shapes, dtypes or config traces again."""

from __future__ import annotations

import json

import torch

from cudabuild.backend.stages.quantize import layout_digest
import _checkpoint as checkpoint


def bundle(folder, seed: int, shape=(8, 4), dtype=torch.bfloat16, config=None) -> dict:
    """A bundle as the stock quantizer writes one: model.safetensors and config.json."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {"layers.0.w": torch.randn(shape, generator=generator).to(dtype), "norm.weight": torch.ones(4)}
    checkpoint.save_file(folder / "model.safetensors", tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 4}))
    return {"model.safetensors": folder / "model.safetensors", "config.json": folder / "config.json"}


def test_new_values_keep_the_layout_and_anything_else_changes_it(tmp_path):
    seed_0 = layout_digest(bundle(tmp_path / "0", seed=0))
    assert layout_digest(bundle(tmp_path / "7", seed=7)) == seed_0
    assert layout_digest(bundle(tmp_path / "shape", seed=0, shape=(4, 8))) != seed_0
    assert layout_digest(bundle(tmp_path / "dtype", seed=0, dtype=torch.float16)) != seed_0
    assert layout_digest(bundle(tmp_path / "config", seed=0, config={"hidden_size": 8})) != seed_0

"""Hugging Face checkpoints of Qwen3.5-MoE, written: a config.json for a named size, and random tensors
under Hugging Face's names and shapes, for tests and benchmarks (no build writes one).

Owns the writing side only. What a checkpoint must hold is the table's (cudabuild/models/
qwen_moe_checkpoint.py: the tensors are exactly those its `expected_tensors` implies, so a written
checkpoint passes the check it is meant to pass, and an edit makes the problem a test asks for);
reading is ExecuTorch's own lazy subset reader, for both forms of the model
(cudabuild/models/qwen35_moe_weights.py `weight_parts`). The tensors are random, scaled so that
activations stay O(1) (fan-in for matrices; decay rates in (0.05, 1)) and verify compares
meaningful numbers. Must not touch: a model's classes, or a build.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

import _checkpoint as checkpoint
from cudabuild.models import qwen35_moe_sizes, qwen35_moe_weights
from cudabuild.models import qwen_moe_checkpoint as fields

PREFIX = "model.language_model."  # Qwen3.5's multimodal checkpoints keep the text tower here


def config_json(size: str = "tiny", dtype: str = "float32", **changes: Any) -> dict:
    """The config.json of a named size (cudabuild/models/qwen35_moe_sizes.py SIZES), its
    weights of `dtype`; each of `changes` sets a field (None: leaves it out)."""
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoEConfig

    config = Qwen35MoEConfig(**qwen35_moe_sizes.SIZES[size])
    out = {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
           **qwen35_moe_weights.hf_config(config), "dtype": dtype, "hidden_act": "silu", "attention_bias": False,
           "max_position_embeddings": config.max_seq_len, "tie_word_embeddings": False}
    for name, value in changes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def random_tensor(name: str, shape: list[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A tensor for the weight `name`, random and scaled for what it does."""
    def normal(mean: float, std: float) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator).to(dtype)

    if name.endswith("A_log"):  # kept in fp32 by checkpoints; decay rates in (0.05, 1)
        return torch.empty(shape).uniform_(0.05, 1.0, generator=generator).log()
    if name.endswith("dt_bias"):
        return normal(0.0, 0.5).float()
    if name.endswith("embed_tokens.weight"):
        return normal(0.0, 1.0)
    if name.endswith("linear_attn.norm.weight"):  # the gated norm: a plain scale around 1
        return normal(1.0, 0.1)
    if len(shape) == 1:  # the other norms: (1 + w), w around 0
        return normal(0.0, 0.1)
    return normal(0.0, shape[-1] ** -0.5)  # [out, in], [E, out, in], conv [C, 1, W]: fan-in last


def tensor_shapes(config: Mapping, prefix: str = PREFIX, fused: bool = True, layers: int = 0) -> dict[str, list[int]]:
    """{name: shape} of every tensor a checkpoint of `config` holds (the table's own answer)."""
    values, problems = fields.checked_fields(config)
    if problems:
        raise ValueError("; ".join(problems))
    return fields.expected_tensors(values, prefix, fused, layers)


def random_tensors(config: Mapping, prefix: str = PREFIX, fused: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, config.get("dtype", "bfloat16"))
    generator = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, shape, dtype, generator)
            for name, shape in sorted(tensor_shapes(config, prefix, fused).items())}


def save(folder: Path, config: Optional[Mapping] = None, prefix: str = PREFIX, fused: bool = True, shards: int = 1,
         seed: int = 0, edit: Optional[Callable[[dict], None]] = None) -> Path:
    """A checkpoint of `config` (default: the tiny size's) in `folder`, as Hugging Face lays one out
    (one model.safetensors, or `shards` files and an index); `edit(tensors)` may change its tensors
    first. Returns the folder."""
    config = dict(config or config_json())
    tensors = random_tensors(config, prefix, fused, seed)
    if edit:
        edit(tensors)
    checkpoint.save_checkpoint(folder, tensors, config, shards=shards)
    return Path(folder)


def layer_of(name: str, prefix: str = PREFIX) -> Optional[int]:
    m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def write_config(folder: Path, config: Mapping) -> None:
    (Path(folder) / checkpoint.CONFIG_FILE).write_text(json.dumps(dict(config), indent=2))

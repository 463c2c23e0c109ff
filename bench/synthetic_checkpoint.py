"""A synthetic Hugging Face checkpoint of qwen_moe at real shapes, written with cudabuild's own writer.

    python bench/synthetic_checkpoint.py DIR [--layers 5] [--size 35b-a3b] [--seed 0]

One shard per decoder layer plus one for the embeddings, the final norm and the head (the way
Hugging Face shards by size, roughly), an index, and a config.json that `qwen_moe_hf.args_from_hf`
reads back to the same shapes. Tensors are random, scaled like the model's own `init_random` (fan-in
for matrices), so activations stay O(1) and verify compares meaningful numbers. Written one shard
at a time: memory stays at about one shard, whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cudabuild.models import checkpoint, qwen_moe, qwen_moe_hf  # noqa: E402
from cudabuild.engine.files import atomic_write_text  # noqa: E402

PREFIX = "model.language_model."
_LAYER = re.compile(re.escape(PREFIX) + r"layers\.(\d+)\.")


def random_tensor(name: str, shape: list[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor as init_random would make it for the parameter this name fills."""
    def normal(mean, std):
        return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=gen).to(dtype)

    if name.endswith("A_log"):  # fp32 in the model; decay rates in (0.05, 1)
        return torch.empty(shape).uniform_(0.05, 1.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return normal(0.0, 0.5).float()
    if name.endswith("embed_tokens.weight"):
        return normal(0.0, 1.0)
    if name.endswith("linear_attn.norm.weight"):  # GatedRMSNorm: a plain scale around 1
        return normal(1.0, 0.1)
    if len(shape) == 1:  # RMSNorm: (1 + w), w around 0
        return normal(0.0, 0.1)
    return normal(0.0, shape[-1] ** -0.5)  # [out, in], [E, out, in], conv [C, 1, W]: fan-in last


def shard_of(name: str) -> str:
    m = _LAYER.match(name)
    return f"layer{int(m.group(1)):03d}" if m else "outer"


def write(path: Path, layers: int, size: str = "35b-a3b", seed: int = 0) -> dict:
    """Write the checkpoint; returns {"bytes": weight bytes, "tensors": n, "shards": n, "seconds": s}."""
    started = time.monotonic()
    args = replace(qwen_moe.SIZES[size].with_layers(layers), n_layers=layers)
    with torch.device("meta"):
        model = qwen_moe.Transformer(args)
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = qwen_moe_hf.hf_targets(args, PREFIX, fused_experts=True)
    groups: dict[str, dict[str, tuple]] = {}
    for name, target in targets.items():
        view = target.view(params)
        groups.setdefault(shard_of(name), {})[name] = (list(view.shape), view.dtype)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    order = sorted(groups)
    weight_map, total = {}, 0
    for i, group in enumerate(order):
        file = f"model-{i + 1:05d}-of-{len(order):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, dtype, gen) for name, (shape, dtype) in groups[group].items()}
        checkpoint.save_file(path / file, tensors, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(path / checkpoint.INDEX_FILE, json.dumps(index, indent=2, sort_keys=True))
    atomic_write_text(path / checkpoint.CONFIG_FILE, json.dumps(qwen_moe_hf.hf_config(args), indent=2))
    return {"bytes": total, "tensors": len(weight_map), "shards": len(order), "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--size", default="35b-a3b", choices=tuple(qwen_moe.SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--info", type=Path, help="also write what was written (bytes, shards, seconds) here, as JSON")
    args = parser.parse_args()
    info = write(args.dir, args.layers, args.size, args.seed)
    if args.info:
        args.info.write_text(json.dumps(info))
    print(f"{args.dir}: {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards, {info['tensors']} tensors, "
          f"{info['seconds']:.1f} s")


if __name__ == "__main__":
    main()

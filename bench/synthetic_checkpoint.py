"""A synthetic Hugging Face checkpoint of qwen_moe at real shapes, written with cudabuild's own writer.

    python bench/synthetic_checkpoint.py DIR [--layers 5] [--size 35b-a3b] [--seed 0]

One shard per decoder layer plus one for the embeddings, the final norm and the head (the way
Hugging Face shards by size, roughly), an index, and a config.json that ExecuTorch's
`Qwen35MoEConfig.from_hf_config` reads back to the same shapes (tests/_qwen35_moe_hf.py).
Tensors are random, scaled for what each does (fan-in for matrices), so activations stay O(1) and
verify compares meaningful numbers. Written one shard at a time: memory stays at about one shard,
whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the checkpoint writers are the tests' (no build writes one)

import torch  # noqa: E402

import _checkpoint as checkpoint  # noqa: E402
import _qwen35_moe_hf as qwen35_moe_hf  # noqa: E402
from cudabuild.models import qwen35_moe_sizes  # noqa: E402
from cudabuild.engine.files import atomic_write_text  # noqa: E402

PREFIX = qwen35_moe_hf.PREFIX
_LAYER = re.compile(re.escape(PREFIX) + r"layers\.(\d+)\.")


def shard_of(name: str) -> str:
    m = _LAYER.match(name)
    return f"layer{int(m.group(1)):03d}" if m else "outer"


def write(path: Path, layers: int, size: str = "35b-a3b", seed: int = 0) -> dict:
    """Write the checkpoint; returns {"bytes": weight bytes, "tensors": n, "shards": n, "seconds": s}."""
    started = time.monotonic()
    base = qwen35_moe_hf.config_json(size, dtype="bfloat16")
    config = dict(base, num_hidden_layers=layers, layer_types=base["layer_types"][:layers])
    dtype = torch.bfloat16
    groups: dict[str, dict[str, list]] = {}
    for name, shape in qwen35_moe_hf.tensor_shapes(config, PREFIX, fused=True).items():
        groups.setdefault(shard_of(name), {})[name] = shape
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    order = sorted(groups)
    weight_map, total = {}, 0
    for i, group in enumerate(order):
        file = f"model-{i + 1:05d}-of-{len(order):05d}.safetensors"
        tensors = {name: qwen35_moe_hf.random_tensor(name, shape, dtype, gen) for name, shape in groups[group].items()}
        checkpoint.save_file(path / file, tensors, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(path / checkpoint.INDEX_FILE, json.dumps(index, indent=2, sort_keys=True))
    atomic_write_text(path / checkpoint.CONFIG_FILE, json.dumps(config, indent=2))
    return {"bytes": total, "tensors": len(weight_map), "shards": len(order), "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--size", default="35b-a3b", choices=tuple(qwen35_moe_sizes.SIZES))
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

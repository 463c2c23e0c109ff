"""The quantize stage of ExecuTorch's Qwen3.5-MoE: its weights built (seeded, or read from a
checkpoint) and quantized once, written as a bundle in the stock format.

Owns: which weights a build starts from (the named sizes, the seeded random init of the stock
exporter's `--tiny-test`, a Hugging Face checkpoint read through ExecuTorch's own loaders, cut to
the first `layers`), their quantization as the stock exporter's `_quantize` does it, and the
bundle: `model.safetensors` (torchao's flattened tensor subclasses, as ExecuTorch's
quantize_and_save writes it) beside a Hugging Face `config.json`. Export loads it with the stock
prequantized loader (cudabuild/models/qwen35_moe.py), and so can the stock exporter
(`export.py --prequantized DIR`).

Must not touch: anything a method, an export or a compile decides. The quantize stage is keyed on
this module's source (and what it imports from the project), so what lives here reruns
quantization when it changes; keep the per-method switches and the runtime buffers elsewhere.

Quantization, step by step as ExecuTorch 1.4.1's export.py `_quantize` (it is not called as is
because it moves layers to "cuda" unconditionally; here the device is a parameter, so the same
steps run on the CPU where torchao can, as the tests do with qlinear=8w):
1. experts: packed int4 (min/max, or HQQ with `hqq`), ExecuTorch's `_quantize_experts_int4`;
2. lm_head untied from the embedding;
3. each layer moved to the device in bf16, its linears quantized (4w: torchao's tile-packed int4,
   the layout `_weight_int4pack_mm` reads), moved back;
4. lm_head likewise; 5. the embedding (`qembedding`); 6. the final norm cast to bf16.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import types
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

# The stock exporter's --tiny-test model: every feature of the real one at a small scale (GQA 2:1,
# GDN key/value heads 1:2, partial RoPE, alternating layer kinds, top-2 of 8 experts, shared
# expert, depthwise conv with state). The other size is Qwen35MoEConfig's defaults: 35B-A3B.
TINY = dict(
    vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_kv_heads=2, head_dim=64,
    partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, full_attention_interval=2,
    rms_norm_eps=1e-6, rope_theta=10_000.0, max_seq_len=64,
)
SIZES = {"tiny": TINY, "35b-a3b": {}}

# Buffers that are per-session state or recomputed at load (ExecuTorch's loader lists the same):
# not part of the weights, and shaped by max_seq_len, which must not key this stage.
RUNTIME_BUFFERS = (".kv_cache.", ".conv_state", ".recurrent_state", ".cache_positions", ".inv_freq", ".mask")

BUNDLE = "model.safetensors"
CONFIG = "config.json"
ADOPTED = "bundle.json"  # names a stock prequantized bundle used in place


def check_bundle(folder: Path) -> None:
    """A stock CUDA bundle: config.json, and a model.safetensors whose header says how to rebuild
    its tensor subclasses (torchao's `tensor_names`, or the legacy `quantization`)."""
    from cudabuild.errors import InvalidOption
    from cudabuild.formats.safetensors_parts import METADATA, HeaderError, read_raw_header

    for name in (CONFIG, BUNDLE):
        if not (folder / name).is_file():
            raise InvalidOption(f"prequantized={folder}", f"no {name} there (a bundle of ExecuTorch's quantize_and_save has both)")
    try:
        header, _, _ = read_raw_header(folder / BUNDLE)
    except HeaderError as e:
        raise InvalidOption(f"prequantized={folder}", f"{BUNDLE} is not readable ({e})") from None
    metadata = header.get(METADATA) or {}
    if "tensor_names" not in metadata and "quantization" not in metadata:
        raise InvalidOption(f"prequantized={folder}", f"{BUNDLE} is not a quantized bundle (its header has no torchao "
                            "tensor_names)", fix="make one with ExecuTorch's quantize_and_save.py")


def model_config(options: Mapping[str, Any]):
    """The Qwen35MoEConfig the options describe (its max_seq_len is the size's: the weights do not
    depend on it)."""
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoEConfig

    if options.get("checkpoint"):
        config = Qwen35MoEConfig.from_hf_config(os.path.join(os.path.expanduser(options["checkpoint"]), CONFIG))
    else:
        config = Qwen35MoEConfig(**SIZES[options["size"]])
    layers = int(options.get("layers") or 0)
    if layers and layers < config.num_hidden_layers:
        config.num_hidden_layers = layers
        config.layer_types = list(config.layer_types[:layers])
    return config


def hf_config(config) -> dict:
    """`config` in the Hugging Face keys Qwen35MoEConfig.from_hf_config reads back."""
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "partial_rotary_factor": config.partial_rotary_factor, "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads, "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim, "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "full_attention_interval": config.full_attention_interval, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "layer_types": list(config.layer_types),
    }


def seeded_model(config, seed: int):
    """The stock --tiny-test model: bf16, every parameter drawn from N(0, 0.02) after `seed`."""
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoE

    torch.manual_seed(seed)
    model = Qwen35MoE(config)
    model.to(dtype=torch.bfloat16)
    for p in model.parameters():
        if p.device.type != "meta":
            p.data.normal_(0, 0.02)
    return _frozen(model)


def _frozen(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _release(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


# -- the streamed quantizer: one part of the model at a time ----------------------------------------
#
# A part is the embedding, one decoder layer, the final norm or the lm_head. Its bf16 weights are
# made (drawn, or read from the checkpoint's shards) on the device, quantized there, moved to the
# host and handed to the bundle's writer, which writes them while the next part is made: the device
# holds about one layer (or the lm_head) at a time, the host one part, never the whole bf16 model.


def _seed_of(seed: int, name: str) -> int:
    """Each drawn tensor's own generator seed: the same tensor whatever the number of layers."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _drawn(module, prefix: str, seed: int, device: str, dtype=torch.bfloat16):
    """`module` (built on meta) given weights of `dtype` on `device`, each parameter from N(0, 0.02)
    by its own generator, as the stock --tiny-test draws every parameter from N(0, 0.02)."""
    module = module.to_empty(device=device).to(dtype)
    for name, p in module.named_parameters():
        generator = torch.Generator(device=device).manual_seed(_seed_of(seed, prefix + name))
        p.data.normal_(0, 0.02, generator=generator)
    return _frozen(module)


def weight_parts(options: Mapping[str, Any], config, device: str,
                 dtype=torch.bfloat16) -> Iterator[tuple[str, torch.nn.Module]]:
    """(prefix, module on `device`, its weights of `dtype`) for every part, in order: the
    embedding, the layers, the norm, the lm_head. The quantize stage quantizes them (bf16); the
    CPU form (cudabuild/models/qwen35_moe_plain.py) assembles them unquantized. A top-level part comes wrapped (`{"lm_head": Linear}`, prefix ""), a layer
    as its Block (prefix `layers.<i>.`), so the module's own names are the model's.

    The tiny size keeps the stock --tiny-test weights exactly (the whole model drawn on the CPU in
    its order, then handed out part by part), so its package can be compared with the stock
    exporter's byte for byte; other sizes draw each tensor on the device; a checkpoint is read a
    part at a time through ExecuTorch's lazy subset reader."""
    from executorch.examples.models.qwen3_5_moe.model import Block, GemmaRMSNorm

    if options.get("checkpoint"):
        yield from _checkpoint_parts(options["checkpoint"], config, device, dtype)
        return
    seed = int(options["seed"])
    if options["size"] == "tiny":
        model = seeded_model(config, seed)
        yield "", _frozen(torch.nn.ModuleDict({"embed_tokens": model.embed_tokens}).to(device, dtype))
        for i, layer in enumerate(model.layers):
            yield f"layers.{i}.", _frozen(layer.to(device, dtype))
        yield "", _frozen(torch.nn.ModuleDict({"norm": model.norm}).to(device, dtype))
        yield "", _frozen(torch.nn.ModuleDict({"lm_head": model.lm_head}).to(device, dtype))
        return
    with torch.device("meta"):
        top = {"embed_tokens": torch.nn.Embedding(config.vocab_size, config.hidden_size),
               "norm": GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
               "lm_head": torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)}
    yield "", _drawn(torch.nn.ModuleDict({"embed_tokens": top["embed_tokens"]}), "", seed, device, dtype)
    for i in range(config.num_hidden_layers):
        with torch.device("meta"):
            block = Block(config, layer_idx=i)
        yield f"layers.{i}.", _drawn(block, f"layers.{i}.", seed, device, dtype)
    for name in ("norm", "lm_head"):
        yield "", _drawn(torch.nn.ModuleDict({name: top[name]}), "", seed, device, dtype)


def _checkpoint_parts(folder: str, config, device: str, dtype=torch.bfloat16) -> Iterator[tuple[str, torch.nn.Module]]:
    from executorch.examples.models.qwen3_5_moe.model import Block, GemmaRMSNorm
    from executorch.examples.models.qwen3_5_moe.quantize_and_save import _load_remapped_subset, _open_checkpoint_shards

    from cudabuild.errors import InvalidOption

    weight_map, handle = _open_checkpoint_shards(os.path.expanduser(folder))

    def read(wanted) -> dict:
        return _load_remapped_subset(weight_map, handle, config, wanted)

    def filled(module, state: dict, prefix: str):
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        module.load_state_dict(own, strict=False, assign=True)
        missing = [prefix + n for n, p in module.named_parameters() if p.device.type == "meta"]
        if missing:
            raise InvalidOption(f"checkpoint={folder}", f"no tensor for {', '.join(missing[:4])}"
                                f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}")
        for name, buf in list(module.named_buffers()):  # runtime state the checkpoint leaves on meta
            if buf.device.type == "meta":
                owner, _, leaf = name.rpartition(".")
                (module.get_submodule(owner) if owner else module).register_buffer(leaf, torch.zeros(buf.shape, dtype=buf.dtype))
        return _frozen(module.to(device=device, dtype=dtype))

    top = read(lambda n: n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))
    if "lm_head.weight" not in top and "embed_tokens.weight" in top:
        top["lm_head.weight"] = top["embed_tokens.weight"]  # tied: the lm_head gets its own copy, as the stock exporter unties it
    with torch.device("meta"):
        wrapped = {"embed_tokens": torch.nn.Embedding(config.vocab_size, config.hidden_size),
                   "norm": GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
                   "lm_head": torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)}
    yield "", filled(torch.nn.ModuleDict({"embed_tokens": wrapped["embed_tokens"]}), top, "")
    for i in range(config.num_hidden_layers):
        with torch.device("meta"):
            block = Block(config, layer_idx=i)
        yield f"layers.{i}.", filled(block, read(lambda n, i=i: n.startswith(f"model.layers.{i}.")), f"layers.{i}.")
    for name in ("norm", "lm_head"):
        yield "", filled(torch.nn.ModuleDict({name: wrapped[name]}), top, "")


def _quantize_part(prefix: str, module, config, options: Mapping[str, Any]) -> None:
    """The stock `_quantize`'s steps for one part, in place, where the part lies: a layer's experts
    to packed int4 and its linears (as the lm_head's) by `qlinear`; the embedding by `qembedding`."""
    from executorch.examples.models.qwen3_5_moe.export import _quantize_experts_int4
    from executorch.extension.llm.export.quantize import quantize_model_

    qlinear, group = options["qlinear"], int(options["qlinear_group_size"])
    packing = "tile_packed_to_4d" if qlinear == "4w" else None
    if prefix.startswith("layers."):
        _quantize_experts_int4(types.SimpleNamespace(layers=[module]), config, group, use_hqq=bool(options["hqq"]))
        quantize_model_(module, qlinear_config=qlinear, qlinear_group_size=group, qlinear_packing_format=packing)
    elif "lm_head" in module:
        quantize_model_(module, qlinear_config=qlinear, qlinear_group_size=group, qlinear_packing_format=packing)
    elif "embed_tokens" in module and options.get("qembedding"):
        quantize_model_(module, qembedding_config=options["qembedding"])


def _flattened(prefix: str, module) -> tuple[dict, dict]:
    """The part's bundle tensors in torchao's flattened form (plain tensors, and metadata that
    rebuilds the subclasses), named from the model's root."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    items = list(module.named_parameters()) + list(module.named_buffers())
    state = {}
    for name, t in items:
        full = prefix + name
        if any(marker in full for marker in RUNTIME_BUFFERS) or full in state:
            continue
        state[full] = t.data if isinstance(t, torch.nn.Parameter) else t
    return flatten_tensor_state_dict(state)


def quantize_streamed(options: Mapping[str, Any], config, path: Path, device: str) -> dict:
    """Make, quantize and write every part in turn; the bundle at `path`. Returns what it measured."""
    from cudabuild.formats.safetensors_stream import SafetensorsStream

    names: list[str] = []
    started = time.monotonic()
    timings = {"make": 0.0, "quantize": 0.0, "hand_off": 0.0}
    with SafetensorsStream(path, expected_tensors=64 * (config.num_hidden_layers + 4)) as out:
        parts = weight_parts(options, config, device)
        while True:
            t0 = time.monotonic()
            part = next(parts, None)
            if part is None:
                break
            prefix, module = part
            t1 = time.monotonic()
            _quantize_part(prefix, module, config, options)
            _synchronize(device)
            t2 = time.monotonic()
            tensors, metadata = _flattened(prefix, module)
            names += json.loads(metadata.pop("tensor_names"))
            out.metadata.update(metadata)
            out.add(tensors)
            del module, tensors
            _release(device)
            timings["make"] += t1 - t0
            timings["quantize"] += t2 - t1
            timings["hand_off"] += time.monotonic() - t2
        out.metadata["tensor_names"] = json.dumps(names)
    timings["seconds"] = time.monotonic() - started
    return {k: round(v, 2) for k, v in timings.items()}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def quantize(options: Mapping[str, Any], folder: Path, device: str) -> dict[str, Path]:
    """Build and quantize the model the options describe, a part at a time; write the bundle into
    `folder`. A stock prequantized bundle (`prequantized=DIR`) is adopted as it is: `bundle.json`
    names it, and its tensors key this stage like a checkpoint's."""
    folder.mkdir(parents=True, exist_ok=True)
    if options.get("prequantized"):
        bundle = Path(options["prequantized"]).expanduser().resolve()
        check_bundle(bundle)
        files = {ADOPTED: folder / ADOPTED}
        files[ADOPTED].write_text(json.dumps({"folder": str(bundle)}))
        return files
    config = model_config(options)
    files = {BUNDLE: folder / BUNDLE, CONFIG: folder / CONFIG}
    quantize_streamed(options, config, files[BUNDLE], device)
    files[CONFIG].write_text(json.dumps(hf_config(config), indent=1, sort_keys=True))
    return files


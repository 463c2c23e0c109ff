"""Where the weights of ExecuTorch's Qwen3.5-MoE come from: a named size's seeded draw, or a Hugging
Face checkpoint, a part at a time, cut to the first `layers`.

Owns the model's config for the options (a size's, or a checkpoint's config.json, cut to the
layers kept), its config as Hugging Face keys (what a bundle's config.json holds), the stock
exporter's `--tiny-test` init (`seeded_model`), each tensor drawn by its own generator past the tiny
size, a checkpoint read through ExecuTorch's own lazy subset reader, and which buffers are runtime
state rather than weights. Both forms start here: the quantize stage quantizes these parts
(qwen35_moe_quantize.py), the CPU form assembles them unquantized (qwen35_moe_plain.py).

Must not touch: the quantization, a method, an export. The quantize stage is keyed on this module's
source too (it imports it), so what lives here reruns quantization when it changes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterator

import torch

from cudabuild.models.qwen35_moe_sizes import SIZES, kept_layers

# Buffers that are per-session state or recomputed at load (ExecuTorch's loader lists the same):
# not part of the weights, and shaped by max_seq_len, which must not key the quantize stage.
RUNTIME_BUFFERS = (".kv_cache.", ".conv_state", ".recurrent_state", ".cache_positions", ".inv_freq", ".mask")
CONFIG = "config.json"  # a Hugging Face checkpoint's, as a bundle's


def model_config(options):
    """The Qwen35MoEConfig the options describe (its max_seq_len is the size's: the weights do not
    depend on it)."""
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoEConfig

    if options.checkpoint:
        config = Qwen35MoEConfig.from_hf_config(os.path.join(os.path.expanduser(options.checkpoint), CONFIG))
    else:
        config = Qwen35MoEConfig(**SIZES[options.size])
    layers = kept_layers(options.layers, config.num_hidden_layers)
    if layers < config.num_hidden_layers:
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


# -- a part at a time ------------------------------------------------------------------------------
#
# A part is the embedding, one decoder layer, the final norm or the lm_head. Its weights are made
# (drawn, or read from the checkpoint's shards) on the device a part at a time, so whoever takes
# them (the quantizer, the CPU form) holds one part, never the whole bf16 model.


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


def weight_parts(options, config, device: str,
                 dtype=torch.bfloat16) -> Iterator[tuple[str, torch.nn.Module]]:
    """(prefix, module on `device`, its weights of `dtype`) for every part, in order: the
    embedding, the layers, the norm, the lm_head. The quantize stage quantizes them (bf16); the
    CPU form (qwen35_moe_plain.py) assembles them unquantized. A top-level part comes wrapped
    (`{"lm_head": Linear}`, prefix ""), a layer as its Block (prefix `layers.<i>.`), so the
    module's own names are the model's.

    The tiny size keeps the stock --tiny-test weights exactly (the whole model drawn on the CPU in
    its order, then handed out part by part), so its package can be compared with the stock
    exporter's byte for byte; other sizes draw each tensor on the device; a checkpoint is read a
    part at a time through ExecuTorch's lazy subset reader."""
    from executorch.examples.models.qwen3_5_moe.model import Block, GemmaRMSNorm

    if options.checkpoint:
        yield from _checkpoint_parts(options.checkpoint, config, device, dtype)
        return
    seed = options.seed
    if options.size == "tiny":
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

"""The Hugging Face side of qwen_moe: config.json -> ModelArgs, and checkpoint tensor names ->
the model's parameters.

Owns what a Qwen3.5-MoE checkpoint means for cudabuild/models/qwen_moe.py: its ModelArgs, read from
config.json's fields once the table of cudabuild/models/qwen_moe_checkpoint.py has checked them
(every field that changes the model's numbers is read, or refused there in one line that names the
field, its value and what is supported; a model that differs from the checkpoint's own definition
is never built silently), and which tensor fills which parameter. Reading the files is
cudabuild/models/checkpoint.py's business.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

import torch

from cudabuild.models import checkpoint
from cudabuild.models import qwen_moe_checkpoint as fields
from cudabuild.models.checkpoint import CheckpointError, Target
from cudabuild.models.qwen_moe import ModelArgs, Transformer, build


def _rope(v: Mapping[str, Any]) -> dict:
    """The rotary fields of ModelArgs from a checked config's rope scaling."""
    rope, kind = v["rope"], v["rope"]["rope_type"]
    out = {"rope_fraction": v["partial_rotary_factor"], "rope_theta": v.get("rope_theta") or 10_000.0, "rope_type": kind}
    if kind == "default":
        return out
    factor = rope["factor"]
    out["rope_factor"] = factor
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or v.get("max_position_embeddings")
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all)) if mscale and mscale_all \
                else _get_mscale(factor)
        out.update(rope_original_max=int(original), rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                   rope_beta_slow=float(rope.get("beta_slow") or 1.0), rope_truncate=bool(rope.get("truncate", True)),
                   rope_attention_factor=float(attention))
    return out


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def args_from_hf(config: Mapping[str, Any], max_seq_len: int, chunk: int, where: str = "config.json") -> ModelArgs:
    """ModelArgs from a Hugging Face config.json (a Qwen3.5-MoE one; `text_config` when nested).

    `where` names the file in messages. Every field is checked by the table of
    cudabuild/models/qwen_moe_checkpoint.py first (type, range, what this form implements); a
    config with problems raises one CheckpointError that carries them all (`problems`).
    """
    v, problems = fields.checked_fields(config, "cpu", where)
    if problems:
        error = CheckpointError("; ".join(problems))
        error.problems = problems
        raise error
    return ModelArgs(
        vocab_size=v["vocab_size"],
        dim=v["hidden_size"],
        n_layers=v["num_hidden_layers"],
        n_heads=v["num_attention_heads"],
        n_kv_heads=v["num_key_value_heads"],
        head_dim=v["head_dim"],
        lin_k_heads=v["linear_num_key_heads"],
        lin_v_heads=v["linear_num_value_heads"],
        lin_k_dim=v["linear_key_head_dim"],
        lin_v_dim=v["linear_value_head_dim"],
        conv_width=v["linear_conv_kernel_dim"],
        n_experts=v["num_experts"],
        top_k=v["num_experts_per_tok"],
        expert_dim=v["moe_intermediate_size"],
        shared_dim=v["shared_expert_intermediate_size"],
        full_attn_every=v["full_attention_interval"],
        max_seq_len=max_seq_len,
        chunk=chunk,
        norm_eps=v["rms_norm_eps"],
        tie_embeddings=bool(v["tie_word_embeddings"]),
        dtype=getattr(torch, v["dtype"]),
        hidden_act=v["hidden_act"],
        **_rope(v),
    )


def max_positions(config: Mapping[str, Any]) -> Optional[int]:
    """The context length the checkpoint supports (max_position_embeddings), if it says."""
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    value = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# The text tower's prefix in Qwen3.5's multimodal checkpoints, and the tensors that are not part of
# the text decoder: the checkpoint table's (cudabuild/models/qwen_moe_checkpoint.py).
HF_PREFIXES, HF_IGNORED = fields.PREFIXES, fields.IGNORED

_HF_LAYER = {  # Hugging Face name inside layer i -> this model's name inside layers.i
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn.w_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn.w_z.weight",
    "linear_attn.in_proj_b.weight": "attn.w_b.weight",
    "linear_attn.in_proj_a.weight": "attn.w_a.weight",
    "linear_attn.conv1d.weight": "attn.conv_w",
    "linear_attn.A_log": "attn.A_log",
    "linear_attn.dt_bias": "attn.dt_bias",
    "linear_attn.norm.weight": "attn.norm.weight",
    "linear_attn.out_proj.weight": "attn.wo.weight",
    "mlp.gate.weight": "moe.router.weight",
    "mlp.shared_expert.gate_proj.weight": "moe.shared.w1.weight",
    "mlp.shared_expert.up_proj.weight": "moe.shared.w3.weight",
    "mlp.shared_expert.down_proj.weight": "moe.shared.w2.weight",
    "mlp.shared_expert_gate.weight": "moe.shared_gate.weight",
}
_FULL_ONLY, _LINEAR_ONLY = "self_attn.", "linear_attn."


def hf_targets(args: ModelArgs, prefix: str = "model.language_model.", fused_experts: bool = True) -> dict[str, Target]:
    """Every Hugging Face tensor name of a checkpoint for `args` -> where it goes in Transformer.

    Experts come either fused (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj`
    [E, D, I]) or one tensor per expert (`mlp.experts.{e}.gate_proj.weight` [I, D], ...), each
    copied into its slice of the stacked parameter.
    """
    I = args.expert_dim
    t: dict[str, Target] = {
        prefix + "embed_tokens.weight": Target("tok_embeddings.weight"),
        prefix + "norm.weight": Target("norm.weight"),
    }
    if not args.tie_embeddings:
        t["lm_head.weight"] = Target("output.weight")
    for i in range(args.n_layers):
        skip = _LINEAR_ONLY if args.is_full_attention(i) else _FULL_ONLY
        for hf, ours in _HF_LAYER.items():
            if not hf.startswith(skip):
                t[f"{prefix}layers.{i}.{hf}"] = Target(f"layers.{i}.{ours}")
        hf, ours = f"{prefix}layers.{i}.mlp.experts.", f"layers.{i}.moe."
        if fused_experts:
            t[hf + "gate_up_proj"] = Target(ours + "w_gate_up")
            t[hf + "down_proj"] = Target(ours + "w_down", transpose=True)
        else:
            for e in range(args.n_experts):
                t[f"{hf}{e}.gate_proj.weight"] = Target(ours + "w_gate_up", index=(e, slice(0, I)))
                t[f"{hf}{e}.up_proj.weight"] = Target(ours + "w_gate_up", index=(e, slice(I, 2 * I)))
                t[f"{hf}{e}.down_proj.weight"] = Target(ours + "w_down", index=(e,), transpose=True)
    return t


hf_layout = fields.layout  # (prefix, fused experts), read off a checkpoint's tensor names


def hf_skipped(args: ModelArgs, prefix: str):
    """A predicate for checkpoint tensors that are deliberately left unread: the vision tower, the
    multi-token-prediction head, and layers beyond a depth cut (`args.n_layers`)."""
    deeper = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")

    def skipped(name: str) -> bool:
        if HF_IGNORED.match(name):
            return True
        m = deeper.match(name)
        return m is not None and int(m.group(1)) >= args.n_layers

    return skipped


def hf_config(args: ModelArgs, dtype: Optional[torch.dtype] = None) -> dict:
    """A Hugging Face config.json for `args` (text config only), as `args_from_hf` reads it."""
    dtype = dtype or args.dtype
    rope = {"rope_type": args.rope_type, "rope_theta": args.rope_theta, "partial_rotary_factor": args.rope_fraction}
    if args.rope_type != "default":
        rope["factor"] = args.rope_factor
    if args.rope_type == "yarn":
        rope.update(original_max_position_embeddings=args.rope_original_max, beta_fast=args.rope_beta_fast,
                    beta_slow=args.rope_beta_slow, truncate=args.rope_truncate, attention_factor=args.rope_attention_factor)
    return {
        "model_type": "qwen3_5_moe_text",
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rope_parameters": rope,
        "hidden_act": args.hidden_act,
        "attention_bias": False,
        "max_position_embeddings": max(args.max_seq_len, args.rope_original_max),
        "linear_num_key_heads": args.lin_k_heads,
        "linear_num_value_heads": args.lin_v_heads,
        "linear_key_head_dim": args.lin_k_dim,
        "linear_value_head_dim": args.lin_v_dim,
        "linear_conv_kernel_dim": args.conv_width,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_dim,
        "shared_expert_intermediate_size": args.shared_dim,
        "full_attention_interval": args.full_attn_every,
        "layer_types": ["full_attention" if args.is_full_attention(i) else "linear_attention" for i in range(args.n_layers)],
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
    }


def from_checkpoint(path, max_seq_len: int, chunk: int, n_layers: int = 0) -> Transformer:
    """A Transformer loaded from a Hugging Face directory (config.json + *.safetensors).

    The weight dtype is the checkpoint's (`dtype`/`torch_dtype` in config.json, else bfloat16);
    `n_layers` > 0 keeps only the first layers.
    """
    config = checkpoint.read_config(path)
    args = args_from_hf(config, max_seq_len=max_seq_len, chunk=chunk, where=f"{path}/config.json").with_layers(n_layers)
    model = build(args, seed=None)
    names = checkpoint.tensor_files(path)
    prefix, fused = hf_layout(names)
    checkpoint.load_into(model, path, hf_targets(args, prefix, fused), skip=hf_skipped(args, prefix))
    model.tie_weights()
    return model

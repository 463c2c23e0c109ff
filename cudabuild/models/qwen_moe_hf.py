"""The Hugging Face side of qwen_moe: config.json -> ModelArgs, and checkpoint tensor names ->
the model's parameters.

Owns what a Qwen3.5-MoE checkpoint means for cudabuild/models/qwen_moe.py: every config.json field
that changes the model's numbers is either read into ModelArgs or refused with one line that names
the field, its value and what is supported; a model that differs from the checkpoint's own
definition is never built silently. Reading the files is cudabuild/models/checkpoint.py's business.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

import torch

from cudabuild.models import checkpoint
from cudabuild.models.checkpoint import CheckpointError, Target
from cudabuild.models.qwen_moe import ACTIVATIONS, ROPE_TYPES, ModelArgs, Transformer, build

# Qwen3.5 rotates a quarter of each head; its configs may leave partial_rotary_factor out.
DEFAULT_PARTIAL_ROTARY = 0.25


def _refused(where: str, field: str, value, supported: str) -> CheckpointError:
    return CheckpointError(f"{where}: {field}={json_value(value)} is not supported; supported: {supported}")


def json_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(c: Mapping[str, Any], where: str) -> dict:
    """The rotary fields of ModelArgs from a text config's rope_parameters / rope_scaling."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    out = {
        "rope_fraction": c.get("partial_rotary_factor", rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)),
        "rope_theta": c.get("rope_theta", rope.get("rope_theta", 10_000.0)),
        "rope_type": kind,
    }
    if kind not in ROPE_TYPES:
        raise _refused(where, "rope_type", kind, ", ".join(ROPE_TYPES))
    if kind == "default":
        return out
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise CheckpointError(f"{where}: rope_type={kind!r} needs a positive 'factor', got {json_value(factor)}")
    out["rope_factor"] = float(factor)
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or c.get("max_position_embeddings")
        if not original:
            raise CheckpointError(f"{where}: rope_type='yarn' needs original_max_position_embeddings or max_position_embeddings")
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all)) if mscale and mscale_all \
                else _get_mscale(factor)
        out.update(rope_original_max=int(original), rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                   rope_beta_slow=float(rope.get("beta_slow") or 1.0), rope_truncate=bool(rope.get("truncate", True)),
                   rope_attention_factor=float(attention))
    return out


def _interval(layer_types, where: str) -> int:
    """full_attention_interval read off a layer_types list (transformers stores only the list)."""
    if not layer_types or "full_attention" not in layer_types:
        raise CheckpointError(f"{where}: neither full_attention_interval nor a layer_types list with a full_attention layer")
    return list(layer_types).index("full_attention") + 1


def _check_layer_types(kinds, args: ModelArgs, where: str) -> None:
    unknown = sorted({k for k in kinds} - {"full_attention", "linear_attention"})
    if unknown:
        raise _refused(where, "layer_types", unknown[0], "'full_attention' and 'linear_attention'")
    if len(kinds) != args.n_layers:
        raise CheckpointError(f"{where}: layer_types lists {len(kinds)} layers, num_hidden_layers is {args.n_layers}")
    expected = ["full_attention" if args.is_full_attention(i) else "linear_attention" for i in range(args.n_layers)]
    if list(kinds) != expected:
        full = [i for i, k in enumerate(kinds) if k == "full_attention"]
        raise CheckpointError(
            f"{where}: layer_types with full_attention at layers {', '.join(map(str, full))} is not supported; "
            "supported: one full_attention layer every N layers, the last of each N (full_attention_interval=N)"
        )


def _dtype(config: Mapping[str, Any], where: str) -> torch.dtype:
    """The weight dtype: `dtype`/`torch_dtype` in config.json (text config first), else bfloat16."""
    text = config.get("text_config", config)
    name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name or "bfloat16", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{where}: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def args_from_hf(config: Mapping[str, Any], max_seq_len: int, chunk: int, where: str = "config.json") -> ModelArgs:
    """ModelArgs from a Hugging Face config.json (a Qwen3.5-MoE one; `text_config` when nested).

    `where` names the file in messages. Fields this model does not implement are refused.
    """
    c = config.get("text_config", config)

    def need(key):
        if key not in c:
            raise CheckpointError(f"{where}: missing '{key}' (a Qwen3.5-MoE text config needs it)")
        return c[key]

    if c.get("attention_bias"):
        raise _refused(where, "attention_bias", c["attention_bias"], "false (no bias on the attention projections)")
    act = c.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _refused(where, "hidden_act", act, ", ".join(ACTIVATIONS))
    if c.get("norm_topk_prob") is False:
        raise _refused(where, "norm_topk_prob", False, "true (the k chosen experts' weights renormalised)")
    args = ModelArgs(
        vocab_size=need("vocab_size"),
        dim=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=need("num_attention_heads"),
        n_kv_heads=need("num_key_value_heads"),
        head_dim=c.get("head_dim") or need("hidden_size") // need("num_attention_heads"),
        lin_k_heads=need("linear_num_key_heads"),
        lin_v_heads=need("linear_num_value_heads"),
        lin_k_dim=need("linear_key_head_dim"),
        lin_v_dim=need("linear_value_head_dim"),
        conv_width=need("linear_conv_kernel_dim"),
        n_experts=need("num_experts"),
        top_k=need("num_experts_per_tok"),
        expert_dim=need("moe_intermediate_size"),
        shared_dim=need("shared_expert_intermediate_size"),
        full_attn_every=c.get("full_attention_interval") or _interval(c.get("layer_types"), where),
        max_seq_len=max_seq_len,
        chunk=chunk,
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
        dtype=_dtype(config, where),
        hidden_act=act,
        **_rope(c, where),
    )
    if c.get("layer_types") is not None:
        _check_layer_types(list(c["layer_types"]), args, where)
    return args


def max_positions(config: Mapping[str, Any]) -> Optional[int]:
    """The context length the checkpoint supports (max_position_embeddings), if it says."""
    value = config.get("text_config", config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


# The text tower's prefix in Qwen3.5's multimodal checkpoints; text-only ones use "model.".
HF_PREFIXES = ("model.language_model.", "model.")
# Tensors of a Qwen3.5 checkpoint that are not part of the text decoder.
HF_IGNORED = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp)")

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


def hf_layout(names) -> tuple[str, bool]:
    """The (prefix, fused_experts) a checkpoint uses, read off its tensor names."""
    names = list(names)
    prefix = next((p for p in HF_PREFIXES if any(n.startswith(p + "layers.") for n in names)), HF_PREFIXES[0])
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    return prefix, fused


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

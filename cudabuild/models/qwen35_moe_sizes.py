"""The named sizes of ExecuTorch's Qwen3.5-MoE, and how many of a model's layers a build keeps.

Owns the table of sizes (the recipe's `size` choices: the stock `--tiny-test` config, and
Qwen35MoEConfig's defaults, 35B-A3B) and the one rule of the `layers` option (`kept_layers`: 0
keeps every layer). Must not touch: torch, the model's classes, a checkpoint's files: the option
table (recipes/qwen_moe.py) and the checkpoint's check (qwen_moe_checkpoint.py), which run before
any stage, read it; and what the weights measure (qwen35_moe.py), since the quantize stage is keyed
on this module too.
"""

from __future__ import annotations

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
# The layers of a size that does not say: Qwen35MoEConfig's default, 35B-A3B's 40.
DEFAULT_LAYERS = 40


def depth(size: str) -> int:
    """The layers of a named size."""
    return SIZES[size].get("num_hidden_layers", DEFAULT_LAYERS)


def kept_layers(layers: int, depth: int) -> int:
    """The layers a build keeps of a model `depth` layers deep: with `layers` 0, every one (the
    option's `meaning`); else the first `layers`, never more than there are (the recipe's resolve
    refuses more than a size or a checkpoint has before anything is built)."""
    return min(layers, depth) if layers > 0 else depth

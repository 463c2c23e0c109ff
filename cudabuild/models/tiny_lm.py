"""tiny_lm's model: a two-layer decoder with a KV cache, small enough to lower in seconds on 2 CPU cores.

Owns the architecture only; recipes/tiny_lm.py declares how it is built and exported (its options,
its methods). Must not touch: options, files, a build. It
exercises what the big recipes need (token embedding, a causal depthwise conv1d, GQA-free
attention over a static KV cache updated in place, tied-free LM head).

Shape letters: B batch (1), T new tokens, S max_seq_len, H heads, D head dim, E embed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 64
    conv_kernel: int = 4

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class KVCache(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        shape = (1, cfg.n_heads, cfg.max_seq_len, cfg.head_dim)  # [B, H, S, D]
        self.register_buffer("k", torch.zeros(shape), persistent=False)
        self.register_buffer("v", torch.zeros(shape), persistent=False)

    def update(self, input_pos, k, v):
        # In-place writes at input_pos keep the cache a mutated buffer of the exported program.
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_in = nn.Linear(cfg.dim, 2 * cfg.dim, bias=False)
        self.mlp_out = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.kv_cache = KVCache(cfg)

    def forward(self, x, input_pos, mask):
        cfg = self.cfg
        T = x.shape[1]
        h = self.norm1(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)  # [B, T, E] each
        q, k, v = (t.view(1, T, cfg.n_heads, cfg.head_dim).transpose(1, 2) for t in (q, k, v))
        keys, values = self.kv_cache.update(input_pos, k, v)  # [B, H, S, D]
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(cfg.head_dim)  # [B, H, T, S]
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values
        x = x + self.wo(attn.transpose(1, 2).reshape(1, T, cfg.dim))
        return x + self.mlp_out(F.silu(self.mlp_in(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Depthwise causal conv over the new tokens: lowered through conv1d -> conv2d.
        self.conv = nn.Conv1d(cfg.dim, cfg.dim, cfg.conv_kernel, groups=cfg.dim, padding=cfg.conv_kernel - 1)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens, input_pos):  # tokens [B, T], input_pos [T]
        T = tokens.shape[1]
        x = self.embed(tokens)  # [B, T, E]
        x = x + self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)
        positions = torch.arange(self.cfg.max_seq_len, device=tokens.device)
        mask = positions[None, :] <= input_pos[:, None]  # [T, S]: causal over the cache
        for layer in self.layers:
            x = layer(x, input_pos, mask)
        return self.lm_head(self.norm(x))  # [B, T, vocab]

"""Tests for cudabuild/models/qwen_moe_hf.py: what a Hugging Face config.json means for the model.

Every field that changes the numbers is read (rope scaling, partial rotary, hidden_act, dtype) or
refused in one line that names the field, its value and what is supported."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from cudabuild.errors import CudabuildError
from cudabuild.models import qwen_moe as qm
from cudabuild.models import qwen_moe_hf as qhf
from cudabuild.models.checkpoint import CheckpointError

TINY = qm.SIZES["tiny"]


def config(**changes) -> dict:
    c = qhf.hf_config(TINY)
    c.update(changes)
    return c


def args_of(c: dict) -> qm.ModelArgs:
    return qhf.args_from_hf(c, max_seq_len=TINY.max_seq_len, chunk=TINY.chunk)


@pytest.mark.parametrize("args", [
    pytest.param(TINY, id="tiny"),
    pytest.param(replace(TINY, rope_type="linear", rope_factor=2.0), id="linear"),
    pytest.param(replace(TINY, rope_type="yarn", rope_factor=4.0, rope_original_max=32, rope_attention_factor=1.2,
                         rope_beta_fast=16.0, rope_truncate=False), id="yarn"),
    pytest.param(replace(TINY, hidden_act="gelu_pytorch_tanh", dtype=torch.bfloat16), id="gelu-bf16"),
    pytest.param(qm.SIZES["35b-a3b"], id="35b-a3b"),
])
def test_the_written_config_reads_back_as_the_same_args(args):
    assert qhf.args_from_hf(qhf.hf_config(args), max_seq_len=args.max_seq_len, chunk=args.chunk) == args


def test_a_missing_partial_rotary_factor_is_the_qwen35_quarter():
    c = config()
    del c["rope_parameters"]["partial_rotary_factor"]
    assert args_of(c).rope_fraction == 0.25
    assert args_of(config(partial_rotary_factor=0.5)).rope_fraction == 0.5


def test_yarn_attention_factor_defaults_from_the_scale():
    c = config(rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                "original_max_position_embeddings": 32})
    args = args_of(c)
    assert (args.rope_type, args.rope_factor, args.rope_original_max) == ("yarn", 4.0, 32)
    assert args.rope_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert (args.rope_beta_fast, args.rope_beta_slow, args.rope_truncate) == (32.0, 1.0, True)


def test_rope_scaling_under_its_older_name_and_key_is_read():
    args = args_of(config(rope_parameters=None, rope_scaling={"type": "linear", "factor": 8.0}))
    assert (args.rope_type, args.rope_factor) == ("linear", 8.0)


@pytest.mark.parametrize("changes, message", [
    pytest.param(dict(attention_bias=True),
                 "config.json: attention_bias=true is not supported; supported: false (no bias on the attention projections)",
                 id="attention-bias"),
    pytest.param(dict(hidden_act="swiglu_oai"),
                 "config.json: hidden_act='swiglu_oai' is not supported; supported: silu, gelu, gelu_pytorch_tanh, relu",
                 id="hidden-act"),
    pytest.param(dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                 "config.json: rope_parameters.rope_type='dynamic' is not supported; supported: default, linear, yarn", id="rope-type"),
    pytest.param(dict(rope_parameters={"rope_type": "linear"}),
                 "config.json: rope_type='linear' needs a positive 'factor', got none", id="rope-factor"),
    pytest.param(dict(layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"]),
                 "config.json: layer_types with full_attention at layers 1, 2 is not supported; supported: one "
                 "full_attention layer every N layers, the last of each N (full_attention_interval=N)", id="layer-pattern"),
    pytest.param(dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
                 "config.json: layer_types='sliding_attention' is not supported; supported: 'full_attention' and "
                 "'linear_attention'", id="layer-kind"),
    pytest.param(dict(norm_topk_prob=False),
                 "config.json: norm_topk_prob=false is not supported; supported: true (the k chosen experts' weights "
                 "renormalised)", id="norm-topk"),
])
def test_fields_the_model_does_not_implement_are_refused_in_one_line(changes, message):
    with pytest.raises(CheckpointError) as info:
        args_of(config(**changes))
    assert str(info.value) == message
    assert isinstance(info.value, CudabuildError) and "\n" not in str(info.value)


def test_the_supported_values_of_those_fields_are_accepted():
    args = args_of(config(attention_bias=False, hidden_act="silu", norm_topk_prob=True))
    assert args == TINY

"""Tests for tests/_checkpoint.py: the safetensors reader and writer; and loading a Hugging
Face checkpoint of the tiny qwen_moe (written by tests/_qwen35_moe_hf.py) through the one
loader both forms use, ExecuTorch's lazy subset reader a part at a time (qwen35_moe_weights
`weight_parts`), into the CPU form."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import _checkpoint as ck
import _qwen35_moe_hf as hf
from _checkpoint import CheckpointError
from conftest import REPO
from cudabuild.models import qwen35_moe_plain as plain
from cudabuild.registry import load_recipe

PREFIX = hf.PREFIX
CPU_DEFAULTS = load_recipe(REPO, "qwen_moe").defaults("cpu")


def load(path, layers=0, max_seq_len=64):
    return plain.build(CPU_DEFAULTS.replace(size="tiny", layers=layers, checkpoint=str(path), seed=0,
                                            max_seq_len=max_seq_len, chunk=8))


def stock(path):
    """ExecuTorch's own whole-model loader, the reference for what the checkpoint holds."""
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoE

    model, _ = Qwen35MoE.from_hf_checkpoint(str(path), max_seq_len=64)
    return dict(model.named_parameters())


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None], torch.arange(tokens.shape[0]))


TOKENS = torch.arange(11) * 37 % 256


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Per-expert tensors in two shards, with a multi-token-prediction head the text model skips."""
    def mtp(tensors):
        tensors["mtp.fc.weight"] = torch.zeros(2, 2)

    return hf.save(tmp_path_factory.mktemp("ckpt") / "sharded", fused=False, shards=2, edit=mtp)


# ---------------------------------------------------------------------------------------------
# The safetensors format


def test_safetensors_round_trip_keeps_dtypes_shapes_and_metadata(tmp_path):
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 1, 4),
        "empty": torch.zeros(0, 3),
        "flag": torch.tensor([True, False, True]),
    }
    ck.save_file(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    header = ck.read_header(tmp_path / "x.safetensors")
    assert header.metadata == {"format": "pt"} and (header.data_start - 8) % 8 == 0
    back = ck.load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_header_layout_is_the_documented_one(tmp_path):
    ck.save_file(tmp_path / "x.safetensors", {"w": torch.ones(2, 2)})
    raw = (tmp_path / "x.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + n]) == {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    assert len(raw) == 8 + n + 16


def test_files_the_safetensors_library_writes_are_read(tmp_path):
    from safetensors.torch import save_file as library_save

    tensors = {"w": torch.randn(4, 3, dtype=torch.bfloat16), "b": torch.arange(5, dtype=torch.int32)}
    library_save(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    back = ck.load_file(tmp_path / "lib.safetensors")
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_file_the_library_refuses_is_named_in_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage!" * 2)
    with pytest.raises(CheckpointError) as info:
        ck.load_file(bad)
    assert str(info.value).startswith(f"{bad}: truncated safetensors file") and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Loading a Hugging Face checkpoint


def test_a_sharded_per_expert_checkpoint_loads_what_the_stock_loader_loads(sharded):
    assert sorted(os.listdir(sharded)) == ["config.json", "model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    model, want = load(sharded), stock(sharded)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_single_file_fused_expert_checkpoint_loads_the_same_weights(tmp_path, sharded):
    tensors = ck.load_file(sharded / "model-00001-of-00002.safetensors")
    tensors.update(ck.load_file(sharded / "model-00002-of-00002.safetensors"))
    del tensors["mtp.fc.weight"]
    for i in range(4):  # the same experts, fused as transformers saves them
        p = f"{PREFIX}layers.{i}.mlp.experts."
        gate = torch.stack([tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(8)])
        up = torch.stack([tensors.pop(f"{p}{e}.up_proj.weight") for e in range(8)])
        tensors[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    ck.save_checkpoint(tmp_path / "single", tensors, json.loads((sharded / "config.json").read_text()))
    assert (tmp_path / "single" / "model.safetensors").is_file()
    fused, per_expert = load(tmp_path / "single"), load(sharded)
    other = dict(per_expert.named_parameters())
    assert all(torch.equal(t, other[name]) for name, t in fused.named_parameters())
    torch.testing.assert_close(logits(fused, TOKENS), logits(per_expert, TOKENS))


def test_a_bf16_checkpoint_loads_into_a_bf16_model(tmp_path):
    path = hf.save(tmp_path / "bf16", hf.config_json(dtype="bfloat16"))
    model = load(path)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.recurrent_state.dtype == torch.bfloat16
    want = stock(path)
    assert torch.equal(model.layers[0].mlp.experts.w1_weight, want["layers.0.mlp.experts.w1_weight"])


def test_a_tied_text_only_checkpoint_gets_its_lm_head_from_the_embedding(tmp_path):
    path = hf.save(tmp_path / "tied", hf.config_json(tie_word_embeddings=True), prefix="model.")
    model = load(path)
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_layer_cut_reads_only_the_first_layers(sharded):
    cut, whole = load(sharded, layers=2), load(sharded)
    assert len(cut.layers) == 2
    assert torch.equal(cut.layers[1].attn.qkv_proj.weight, whole.layers[1].attn.qkv_proj.weight)

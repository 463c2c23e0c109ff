"""Tests for cudabuild/models/checkpoint.py: the safetensors reader and writer, and loading a Hugging Face
checkpoint of the tiny qwen_moe model (written here under Hugging Face names) into a fresh model."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from cudabuild.models import checkpoint as ck
from cudabuild.models.checkpoint import CheckpointError
from cudabuild.errors import CudabuildError
from cudabuild.models import qwen_moe as qm
from cudabuild.models import qwen_moe_hf as qhf

ARGS = qm.SIZES["tiny"]
PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def source():
    return qm.build(ARGS, seed=0)


def write(path, source, fused=False, shards=2, edit=None, tie=False):
    """A Hugging Face checkpoint of `source` at `path`; `edit(tensors)` may change it first."""
    tensors = ck.gather_tensors(source, qhf.hf_targets(ARGS, PREFIX, fused_experts=fused))
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)  # a part of real checkpoints the text model skips
    if edit:
        edit(tensors)
    ck.save_checkpoint(path, tensors, qhf.hf_config(ARGS, torch.float32), shards=shards)
    return path


def load(path, n_layers=0):
    return qhf.from_checkpoint(path, max_seq_len=ARGS.max_seq_len, chunk=ARGS.chunk, n_layers=n_layers)


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None], torch.arange(tokens.shape[0]))


TOKENS = torch.arange(11) * 37 % ARGS.vocab_size


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, source):
    return write(tmp_path_factory.mktemp("ckpt") / "sharded", source)


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


def test_sharded_per_expert_checkpoint_loads_into_an_equal_model(sharded, source):
    files = sorted(os.listdir(sharded))
    assert files == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    model = load(sharded)
    for (name, want), got in zip(source.named_parameters(), model.parameters()):
        assert torch.equal(got, want), name
    assert torch.equal(logits(model, TOKENS), logits(source, TOKENS))


def test_single_file_fused_expert_checkpoint_loads(tmp_path, source):
    model = load(write(tmp_path / "single", source, fused=True, shards=1))
    assert (tmp_path / "single" / "model.safetensors").is_file()
    assert torch.equal(logits(model, TOKENS), logits(source, TOKENS))


def test_bf16_checkpoint_loads_into_a_bf16_model(tmp_path, source):
    def to_bf16(tensors):
        for name in tensors:
            tensors[name] = tensors[name].bfloat16()

    path = write(tmp_path / "bf16", source, edit=to_bf16)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    model = load(path)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.A_log.dtype == torch.float32  # kept in fp32 whatever the checkpoint
    assert torch.equal(model.layers[0].moe.w_gate_up, source.layers[0].moe.w_gate_up.bfloat16())


def test_config_fields_that_change_the_numbers_reach_the_model(tmp_path, source):
    path = write(tmp_path / "yarn", source)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32}  # no partial_rotary_factor: 0.25
    config["hidden_act"] = "gelu_pytorch_tanh"
    (path / "config.json").write_text(json.dumps(config))
    args = load(path).args
    assert (args.rope_type, args.rope_factor, args.rope_original_max, args.rope_fraction) == ("yarn", 4.0, 32, 0.25)
    assert args.hidden_act == "gelu_pytorch_tanh"
    assert not torch.equal(logits(load(path), TOKENS), logits(source, TOKENS))


def test_layer_cut_reads_only_the_first_layers(sharded, source):
    model = load(sharded, n_layers=2)
    assert len(model.layers) == 2
    assert torch.equal(model.layers[1].attn.wq.weight, source.layers[1].attn.wq.weight)


def test_missing_tensor_is_named_with_the_index(tmp_path, source):
    name = PREFIX + "layers.2.mlp.experts.5.up_proj.weight"
    path = write(tmp_path / "c", source, edit=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}' in .*model.safetensors.index.json"):
        load(path)


def test_unexpected_tensor_is_named_with_its_file(tmp_path, source):
    name = PREFIX + "layers.0.self_attn.q_proj.weight"  # layer 0 is a linear-attention layer
    path = write(tmp_path / "c", source, edit=lambda t: t.update({name: torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{name}' in .*model-0000[12]-of-00002.safetensors"):
        load(path)


def test_misshaped_tensor_is_named_with_its_file_and_both_shapes(tmp_path, source):
    name = PREFIX + "layers.1.self_attn.k_proj.weight"
    path = write(tmp_path / "c", source, edit=lambda t: t.update({name: torch.zeros(63, 128)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*\.safetensors has shape \[63, 128\], expected \[64, 128\]"):
        load(path)


def test_truncated_shard_is_named(tmp_path, source):
    path = write(tmp_path / "c", source)
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard}: truncated safetensors file"):
        load(path)


def test_missing_config_is_named(tmp_path, source):
    path = write(tmp_path / "c", source)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load(path)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'}: checkpoint directory not found"):
        load(tmp_path / "nope")


def test_errors_are_one_line_cudabuild_errors(tmp_path):
    with pytest.raises(CudabuildError) as info:
        load(tmp_path / "nope")
    assert "\n" not in str(info.value)

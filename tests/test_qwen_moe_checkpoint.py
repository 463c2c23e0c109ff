"""Tests for cudabuild/models/qwen_moe_checkpoint.py: config.json's fields checked against one table
(type, range, choices per form, how fields relate), and the tensors they imply checked against the
safetensors headers, reading no tensor data; every problem collected, one line each."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from cudabuild.models import checkpoint as ck
from cudabuild.models import qwen_moe as qm
from cudabuild.models import qwen_moe_checkpoint as qc
from cudabuild.models import qwen_moe_hf as qhf
from cudabuild.models import safetensors_parts

TINY = qm.SIZES["tiny"]
PREFIX = "model.language_model."


def write(path, args=TINY, fused=True, shards=1, prefix=PREFIX, edit=None, **changes):
    """A checkpoint of a model of `args`, as a Hugging Face one lays it out."""
    model = qm.build(args, seed=0)
    tensors = ck.gather_tensors(model, qhf.hf_targets(args, prefix, fused_experts=fused))
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)  # a part of real checkpoints neither form reads
    if edit:
        edit(tensors)
    config = qhf.hf_config(args)
    config.update(changes)
    ck.save_checkpoint(path, tensors, config, shards=shards)
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write(tmp_path_factory.mktemp("ckpt") / "good", shards=2)


def test_the_table_knows_what_the_plain_pytorch_form_implements():
    assert qc.ACTIVATIONS == tuple(qm.ACTIVATIONS) and qc.ROPE_TYPES == qm.ROPE_TYPES


@pytest.mark.parametrize("args, fused, layers", [
    pytest.param(TINY, True, 0, id="tiny-fused"),
    pytest.param(TINY, False, 0, id="tiny-per-expert"),
    pytest.param(replace(TINY, tie_embeddings=True), True, 3, id="tied-3-layers"),
    pytest.param(qm.SIZES["35b-a3b"], False, 4, id="35b-a3b-4-layers"),
])
def test_the_implied_tensors_are_those_the_loader_fills(args, fused, layers):
    """Names and shapes from the fields alone are what qwen_moe_hf maps onto the model's parameters."""
    with torch.device("meta"):
        model = qm.build(args.with_layers(layers), seed=None)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {name: list(t.view(params).shape) for name, t in qhf.hf_targets(model.args, PREFIX, fused).items()}
    fields, problems = qc.checked_fields(qhf.hf_config(args), "cpu")
    assert problems == []
    assert qc.expected_tensors(fields, PREFIX, fused, layers) == loaded


@pytest.mark.parametrize("form", qc.FORMS)
@pytest.mark.parametrize("kind", ["sharded", "per-expert", "tied-text-only", "bf16-gelu"])
def test_checkpoints_written_as_hugging_face_writes_them_pass(tmp_path, kind, form):
    if kind == "sharded":
        folder = write(tmp_path / kind, shards=3)
    elif kind == "per-expert":
        folder = write(tmp_path / kind, fused=False)
    elif kind == "tied-text-only":
        folder = write(tmp_path / kind, replace(TINY, tie_embeddings=True), prefix="model.")
    else:  # the delta rule's decay stays float32 beside bfloat16 weights
        folder = write(tmp_path / kind, replace(TINY, dtype=torch.bfloat16, hidden_act="silu" if form == "cuda" else "gelu"))
    fields, problems = qc.check_checkpoint(folder, form)
    assert problems == [] and fields["num_hidden_layers"] == 4


def test_the_check_reads_headers_and_never_tensor_data(good, monkeypatch):
    shards = sorted(good.glob("*.safetensors"))
    spans = {str(s): safetensors_parts.read_raw_header(s)[1:] for s in shards}  # (data start, size)
    read = {}
    real_open = open

    class Counting:
        def __init__(self, path, mode="r", *args, **kwargs):
            self.path, self.file = str(path), real_open(path, mode, *args, **kwargs)

        def read(self, n=-1):
            data = self.file.read(n)
            read[self.path] = read.get(self.path, 0) + len(data)
            return data

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(safetensors_parts, "open", Counting, raising=False)
    assert qc.check_checkpoint(good, "cpu")[1] == []
    assert sorted(read) == sorted(spans)
    for shard, (start, size) in spans.items():
        assert read[shard] == start < size  # the header's length and the header, once: no tensor byte


def config_of(**changes):
    c = qhf.hf_config(TINY)
    for name, value in changes.items():
        if value is None:
            c.pop(name, None)
        else:
            c[name] = value
    return c


@pytest.mark.parametrize("changes, form, problem", [
    (dict(hidden_size="banana"), "cpu", "hidden_size='banana' is not an integer; expected an integer >= 1"),
    (dict(num_attention_heads=0), "cpu", "num_attention_heads=0 is out of range; expected an integer >= 1"),
    (dict(vocab_size=True), "cpu", "vocab_size=true is not an integer; expected an integer >= 1"),
    (dict(num_experts=8.0), "cpu", "num_experts=8.0 is not an integer; expected an integer >= 1"),
    (dict(rms_norm_eps=0), "cpu", "rms_norm_eps=0 is out of range; expected a number > 0"),
    (dict(partial_rotary_factor=1.5), "cpu", "partial_rotary_factor=1.5 is out of range; expected a number > 0 <= 1"),
    (dict(moe_intermediate_size=None), "cpu", "missing 'moe_intermediate_size' (a Qwen3.5-MoE text config needs it)"),
    (dict(tie_word_embeddings="yes"), "cpu", "tie_word_embeddings='yes' is not true or false; expected true or false"),
    (dict(dtype="int8"), "cpu", "dtype='int8' is not supported; supported: float32, float16, bfloat16, float64"),
    (dict(layer_types="full"), "cpu", "layer_types='full' is not a list; expected a list"),
    (dict(rope_parameters=[]), "cpu", "rope_parameters=[] is not a JSON object; expected a JSON object"),
    (dict(rope_parameters={"rope_type": "linear", "factor": "2"}), "cpu",
     "rope_parameters.factor='2' is not a number; expected a number > 0"),
    (dict(hidden_act="gelu"), "cuda", "hidden_act='gelu' is not supported on target cuda; supported: silu"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "cuda",
     "rope_parameters.rope_type='linear' is not supported on target cuda; supported: default"),
    (dict(num_key_value_heads=3), "cpu", "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(num_experts_per_tok=9), "cpu", "num_experts_per_tok=9 is more than num_experts=8"),
    (dict(head_dim=3), "cpu", "head_dim=3 x partial_rotary_factor=0.25 rotates 0 dims; expected an even number >= 2"),
    (dict(layer_types=["full_attention"] * 3), "cpu", "layer_types lists 3 layers, num_hidden_layers is 4"),
    (dict(full_attention_interval=None, layer_types=["linear_attention"] * 4), "cpu",
     "neither full_attention_interval nor a layer_types list with a full_attention layer"),
])
def test_each_field_has_a_type_and_a_range(changes, form, problem):
    assert qc.checked_fields(config_of(**changes), form, "c.json")[1] == ["c.json: " + problem]


def test_a_pattern_of_layers_only_the_cpu_form_cannot_follow():
    irregular = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    assert qc.checked_fields(config_of(layer_types=irregular), "cuda")[1] == []
    assert qc.checked_fields(config_of(layer_types=irregular), "cpu")[1] == [
        "config.json: layer_types with full_attention at layers 1, 2 is not supported; supported: one full_attention "
        "layer every N layers, the last of each N (full_attention_interval=N)"]


def test_every_problem_of_a_config_is_reported_at_once():
    problems = qc.checked_fields(config_of(hidden_size="x", num_experts=0, attention_bias=True, vocab_size=None), "cpu")[1]
    assert problems == [
        "config.json: missing 'vocab_size' (a Qwen3.5-MoE text config needs it)",
        "config.json: hidden_size='x' is not an integer; expected an integer >= 1",
        "config.json: num_experts=0 is out of range; expected an integer >= 1",
        "config.json: attention_bias=true is not supported; supported: false (no bias on the attention projections)",
    ]


@pytest.mark.parametrize("config", [[1, 2], "x", 3, None])
def test_a_config_that_is_not_an_object_is_one_line(config):
    problems = qc.checked_fields(config, "cpu")[1]
    assert len(problems) == 1 and problems[0].startswith("config.json: not a JSON object")


def damaged(good, tmp_path, how):
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    index = folder / qc.INDEX_FILE
    weight_map = json.loads(index.read_text())["weight_map"]
    if how == "missing":
        name = PREFIX + "layers.2.mlp.gate.weight"
        del weight_map[name]
        index.write_text(json.dumps({"weight_map": weight_map}))
        return folder, [f"missing tensor '{name}' in {index}"]
    if how == "listed-elsewhere":
        name = PREFIX + "norm.weight"
        other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
        weight_map[name] = other
        index.write_text(json.dumps({"weight_map": weight_map}))
        return folder, [f"tensor '{name}': {index} lists it in {other}, which does not hold it"]
    if how == "no-shard":
        shard = sorted(folder.glob("*.safetensors"))[0]
        shard.unlink()
        return folder, [f"{shard}: no such file (listed by {qc.INDEX_FILE})"]
    if how == "index":
        index.write_text("{}")
        return folder, [f"{index}: not a safetensors index (no readable weight_map: 'weight_map')"]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing", "listed-elsewhere", "no-shard", "index"])
def test_the_files_must_hold_what_the_index_lists(good, tmp_path, how):
    folder, expected = damaged(good, tmp_path, how)
    assert qc.check_checkpoint(folder, "cpu")[1] == expected


def test_every_tensor_problem_is_named_with_its_file(tmp_path):
    gate, norm, head = PREFIX + "layers.0.mlp.gate.weight", PREFIX + "norm.weight", "lm_head.weight"

    def edit(tensors):
        tensors[gate] = tensors[gate][:7].clone()
        tensors[head] = tensors[head].to(torch.float16)
        del tensors[norm]
        tensors[PREFIX + "layers.0.mlp.extra"] = torch.zeros(1)

    folder = write(tmp_path / "ckpt", edit=edit)
    file = folder / "model.safetensors"
    assert qc.check_checkpoint(folder, "cpu")[1] == [
        f"unexpected tensor '{PREFIX}layers.0.mlp.extra' in {file}: a Qwen3.5-MoE checkpoint of this config.json has "
        "no such weight",
        f"missing tensor '{norm}' in {folder}",
        f"tensor '{head}' in {file} is F16, config.json's dtype float32 implies F32",
        f"tensor '{gate}' in {file} has shape [7, 128], config.json implies [8, 128]",
    ]


def test_a_cut_reads_and_checks_only_the_layers_it_keeps(tmp_path):
    def break_layer_3(tensors):
        name = PREFIX + "layers.3.mlp.gate.weight"
        tensors[name] = tensors[name][:7].clone()

    folder = write(tmp_path / "ckpt", edit=break_layer_3)
    assert qc.check_checkpoint(folder, "cpu", layers=3)[1] == []
    assert len(qc.check_checkpoint(folder, "cpu")[1]) == 1
    assert qc.check_checkpoint(folder, "cpu", layers=5)[1] == ["qwen_moe option layers=5: the checkpoint has 4"]


def test_a_damaged_header_is_one_line(good, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    problems = qc.check_checkpoint(folder, "cpu")[1]
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: safetensors header is not valid JSON")

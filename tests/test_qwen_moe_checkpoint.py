"""Tests for cudabuild/models/qwen_moe_checkpoint.py: config.json's fields checked against one table
(type, range, choices, how fields relate), and the tensors they imply checked against the
safetensors headers, reading no tensor data; every problem collected, one line each."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import _qwen35_moe_hf as hf
from cudabuild.models import qwen_moe_checkpoint as qc
from cudabuild.formats import safetensors_parts

PREFIX = hf.PREFIX


def write(path, config=None, fused=True, shards=1, prefix=PREFIX, edit=None, **changes):
    """A checkpoint of the tiny size (or `config`), as a Hugging Face one lays it out."""
    def edited(tensors):
        tensors["mtp.fc.weight"] = torch.zeros(2, 2)  # a part of real checkpoints the model does not read
        if edit:
            edit(tensors)

    return hf.save(path, config or hf.config_json(**changes), prefix=prefix, fused=fused, shards=shards, edit=edited)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write(tmp_path_factory.mktemp("ckpt") / "good", shards=2)


@pytest.mark.parametrize("fused, changes", [
    pytest.param(True, {}, id="tiny-fused"),
    pytest.param(False, {}, id="tiny-per-expert"),
    pytest.param(True, {"tie_word_embeddings": True}, id="tied"),
])
def test_the_implied_tensors_are_those_executorchs_loader_fills(tmp_path, fused, changes):
    """A checkpoint of exactly the tensors the fields imply fills every parameter of ExecuTorch's
    model through its own loader, and nothing is left over."""
    from executorch.examples.models.qwen3_5_moe.model import _load_and_remap_checkpoint, Qwen35MoE, Qwen35MoEConfig

    folder = hf.save(tmp_path / "ckpt", hf.config_json(**changes), fused=fused)
    config = Qwen35MoEConfig.from_hf_config(str(folder / "config.json"))
    with torch.device("meta"):
        model = Qwen35MoE(config)
    state = _load_and_remap_checkpoint(str(folder), config)
    assert sorted(state) == sorted(name for name, _ in model.named_parameters())
    assert all(list(state[n].shape) == list(p.shape) for n, p in model.named_parameters())


def test_a_cut_implies_the_tensors_of_a_model_that_deep():
    config = hf.config_json(size="35b-a3b")
    three = hf.config_json(size="35b-a3b", num_hidden_layers=3, layer_types=config["layer_types"][:3])
    assert hf.tensor_shapes(config, fused=False, layers=3) == hf.tensor_shapes(three, fused=False)


@pytest.mark.parametrize("kind", ["sharded", "per-expert", "tied-text-only", "bf16"])
def test_checkpoints_written_as_hugging_face_writes_them_pass(tmp_path, kind):
    if kind == "sharded":
        folder = write(tmp_path / kind, shards=3)
    elif kind == "per-expert":
        folder = write(tmp_path / kind, fused=False)
    elif kind == "tied-text-only":
        folder = write(tmp_path / kind, prefix="model.", tie_word_embeddings=True)
    else:  # the delta rule's decay stays float32 beside bfloat16 weights
        folder = write(tmp_path / kind, dtype="bfloat16")
    fields, problems = qc.check_checkpoint(folder)
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
    assert qc.check_checkpoint(good)[1] == []
    assert sorted(read) == sorted(spans)
    for shard, (start, size) in spans.items():
        assert read[shard] == start < size  # the header's length and the header, once: no tensor byte


def config_of(**changes):
    return hf.config_json(**changes)


@pytest.mark.parametrize("changes, problem", [
    (dict(hidden_size="banana"), "hidden_size='banana' is not an integer; expected an integer >= 1"),
    (dict(num_attention_heads=0), "num_attention_heads=0 is out of range; expected an integer >= 1"),
    (dict(vocab_size=True), "vocab_size=true is not an integer; expected an integer >= 1"),
    (dict(num_experts=8.0), "num_experts=8.0 is not an integer; expected an integer >= 1"),
    (dict(rms_norm_eps=0), "rms_norm_eps=0 is out of range; expected a number > 0"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor=1.5 is out of range; expected a number > 0 <= 1"),
    (dict(moe_intermediate_size=None), "missing 'moe_intermediate_size' (a Qwen3.5-MoE text config needs it)"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings='yes' is not true or false; expected true or false"),
    (dict(dtype="int8"), "dtype='int8' is not supported; supported: float32, float16, bfloat16, float64"),
    (dict(layer_types="full"), "layer_types='full' is not a list; expected a list"),
    (dict(rope_parameters=[]), "rope_parameters=[] is not a JSON object; expected a JSON object"),
    (dict(rope_parameters={"rope_type": "default", "factor": "2"}),
     "rope_parameters.factor='2' is not a number; expected a number > 0"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; supported: silu"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
     "rope_parameters.rope_type='linear' is not supported; supported: default"),
    (dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is more than num_experts=8"),
    (dict(head_dim=3), "head_dim=3 x partial_rotary_factor=0.25 rotates 0 dims; expected an even number >= 2"),
    (dict(layer_types=["full_attention"] * 3), "layer_types lists 3 layers, num_hidden_layers is 4"),
    (dict(full_attention_interval=None, layer_types=["linear_attention"] * 4),
     "neither full_attention_interval nor a layer_types list with a full_attention layer"),
])
def test_each_field_has_a_type_and_a_range(changes, problem):
    assert qc.checked_fields(config_of(**changes), "c.json")[1] == ["c.json: " + problem]


def test_any_pattern_of_layers_is_followed():
    irregular = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    fields, problems = qc.checked_fields(config_of(layer_types=irregular))
    assert problems == [] and fields["layer_types"] == irregular


def test_every_problem_of_a_config_is_reported_at_once():
    problems = qc.checked_fields(config_of(hidden_size="x", num_experts=0, attention_bias=True, vocab_size=None))[1]
    assert problems == [
        "config.json: missing 'vocab_size' (a Qwen3.5-MoE text config needs it)",
        "config.json: hidden_size='x' is not an integer; expected an integer >= 1",
        "config.json: num_experts=0 is out of range; expected an integer >= 1",
        "config.json: attention_bias=true is not supported; supported: false (no bias on the attention projections)",
    ]


@pytest.mark.parametrize("config", [[1, 2], "x", 3, None])
def test_a_config_that_is_not_an_object_is_one_line(config):
    problems = qc.checked_fields(config)[1]
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
    assert qc.check_checkpoint(folder)[1] == expected


def test_every_tensor_problem_is_named_with_its_file(tmp_path):
    gate, norm, head = PREFIX + "layers.0.mlp.gate.weight", PREFIX + "norm.weight", "lm_head.weight"

    def edit(tensors):
        tensors[gate] = tensors[gate][:7].clone()
        tensors[head] = tensors[head].to(torch.float16)
        del tensors[norm]
        tensors[PREFIX + "layers.0.mlp.extra"] = torch.zeros(1)

    folder = write(tmp_path / "ckpt", edit=edit)
    file = folder / "model.safetensors"
    assert qc.check_checkpoint(folder)[1] == [
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
    assert qc.check_checkpoint(folder, layers=3)[1] == []
    assert len(qc.check_checkpoint(folder)[1]) == 1
    # More layers than it has: every layer is checked here; that it has fewer is resolve's to say.
    assert qc.check_checkpoint(folder, layers=5)[1] == qc.check_checkpoint(folder)[1]


def test_more_layers_than_the_weights_have_is_said_once_by_resolve(good):
    """`layers` is checked in two places, each for what only it knows: its range by the option
    table, its bound by the recipe's resolve against the depth of the weights' source (the size's
    or the checkpoint's config.json), one line either way."""
    from conftest import REPO
    from cudabuild import registry
    from cudabuild.errors import InvalidConfig

    recipe = registry.load_recipe(REPO, "qwen_moe")
    base = recipe.defaults("cpu")
    for given, said in (({"checkpoint": str(good), "layers": 5}, "the checkpoint has 4"),
                        ({"layers": 9}, "the size tiny has 4")):
        with pytest.raises(InvalidConfig) as raised:
            recipe.resolve(base.replace(**given))
        assert raised.value.problems == [f"qwen_moe option layers={given['layers']}: {said}"]
    assert recipe.resolve(base.replace(checkpoint=str(good), layers=4)).layers == 4


def test_a_damaged_header_is_one_line(good, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    problems = qc.check_checkpoint(folder)[1]
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: safetensors header is not valid JSON")

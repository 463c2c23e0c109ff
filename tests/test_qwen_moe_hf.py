"""Tests for tests/_qwen35_moe_hf.py (Hugging Face checkpoints of Qwen3.5-MoE, written), and
the parity of qwen_moe's CPU form with transformers' Qwen3.5-MoE on the released naming.

The parity test needs transformers 5 (its `qwen3_5_moe` model; `scripts/bootstrap.sh --test`
installs it) and is skipped without it."""

from __future__ import annotations

import pytest
import torch

import _qwen35_moe_hf as hf
from conftest import REPO
from cudabuild.models import qwen35_moe_plain as plain
from cudabuild.models import qwen35_moe_sizes as sizes
from cudabuild.registry import load_recipe


def test_the_written_config_reads_back_as_the_sizes_config(tmp_path):
    from executorch.examples.models.qwen3_5_moe.model import Qwen35MoEConfig

    for size in sizes.SIZES:
        hf.write_config(tmp_path, hf.config_json(size))
        read = Qwen35MoEConfig.from_hf_config(str(tmp_path / "config.json"))
        assert vars(read) == {**vars(Qwen35MoEConfig(**sizes.SIZES[size])), "max_seq_len": 4096}, size


def test_a_written_checkpoint_holds_exactly_the_implied_tensors_in_its_dtype(tmp_path):
    folder = hf.save(tmp_path / "ckpt", hf.config_json(dtype="bfloat16"), fused=False, shards=2)
    import _checkpoint as ck

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(ck.load_file(shard))
    assert {n: list(t.shape) for n, t in tensors.items()} == hf.tensor_shapes(hf.config_json(), fused=False)
    assert tensors[hf.PREFIX + "layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert tensors[hf.PREFIX + "layers.0.linear_attn.A_log"].dtype == torch.float32  # kept fp32, as checkpoints do
    assert (tensors[hf.PREFIX + "layers.0.linear_attn.A_log"].exp() < 1).all()  # decay rates in (0.05, 1)


def test_the_cpu_form_computes_transformers_logits_from_one_checkpoint(tmp_path):
    """One checkpoint in Hugging Face's names and layout (fused experts, the multimodal prefix),
    read by transformers' own Qwen3.5-MoE and by the CPU form (ExecuTorch's model through its loader,
    transformed): the same logits after a prompt, and for each token decoded one at a time."""
    transformers = pytest.importorskip("transformers", minversion="5.2")
    folder = hf.save(tmp_path / "ckpt", hf.config_json(), seed=1)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3_5MoeForCausalLM"
    cpu = load_recipe(REPO, "qwen_moe").defaults("cpu")
    ours = plain.build(cpu.replace(size="tiny", layers=0, checkpoint=str(folder), seed=0, max_seq_len=64, chunk=8))
    tokens = (torch.arange(20) * 37 + 11) % 256
    with torch.no_grad():
        want = theirs(tokens[None]).logits[0]  # [T, V]: every position's
        torch.testing.assert_close(ours(tokens[None], torch.arange(20))[0], want[-1], atol=1e-4, rtol=1e-4)
        for t in range(20):
            torch.testing.assert_close(ours(tokens[None, t : t + 1], torch.tensor([t]))[0], want[t], atol=1e-4, rtol=1e-4)

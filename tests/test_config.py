"""Tests for cudabuild/config.py: one build's settings merged once, every problem reported together,
recipe options checked (type, choices) and resolved (qwen_moe's max_seq_len and chunk) up front."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from cudabuild.config import InvalidConfig, _coerce, load_config
from cudabuild.engine.store import Store
from cudabuild.errors import CudabuildError, InvalidOption


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "cache")
    yield store
    store.close()


def problems(store, **cli) -> list[str]:
    with pytest.raises(InvalidConfig) as info:
        load_config(REPO, cli, store)
    assert str(info.value) == "; ".join(info.value.problems)
    return info.value.problems


def test_every_problem_is_reported_at_once_one_line_each(store):
    found = problems(store, model="tiny_lm", target="cpu", sizee="1", max_autotune="MAYBE")
    assert len(found) == 2 and all("\n" not in p for p in found)
    assert found[0].startswith("unknown setting 'sizee' for model tiny_lm; recipe options: layers, seed;")
    assert found[1] == "invalid value max_autotune=MAYBE (command line); expected ON or OFF"


def test_options_specs_target_and_autotune_problems_come_together(store):
    found = problems(store, model="qwen_moe", target="tpu", layers="x", size="huge", autotune="always",
                     checkpoint="/no/such/dir")
    assert found == [
        "unknown target 'tpu'; expected auto, cpu or cuda",
        "qwen_moe option layers=x: expected an integer (default 0)",
        "qwen_moe option size=huge: expected one of tiny, 35b-a3b (default tiny)",
        "checkpoint directory /no/such/dir does not exist",
        "autotune=always: expected auto or pin",
    ]


def test_option_messages_name_the_model_the_type_and_the_default():
    with pytest.raises(InvalidOption, match=r"^m option fast=maybe: expected true or false \(default false\)$"):
        _coerce("m", "fast", False, "maybe")
    with pytest.raises(InvalidOption, match=r"^m option scale=big: expected a number \(default 1.5\)$"):
        _coerce("m", "scale", 1.5, "big")
    assert _coerce("m", "fast", False, "ON") is True and _coerce("m", "scale", 1.5, "2") == 2.0
    assert _coerce("m", "size", "tiny", "35b-a3b", ["tiny", "35b-a3b"]) == "35b-a3b"


def test_qwen_moe_lengths_come_from_the_size_and_are_in_the_options(store):
    assert dict(load_config(REPO, {"model": "qwen_moe", "target": "cpu"}, store).options) == {
        "size": "tiny", "layers": 0, "seed": 0, "checkpoint": "", "max_seq_len": 128, "chunk": 8}
    sized = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "size": "35b-a3b", "layers": "2"}, store).options
    assert (sized["max_seq_len"], sized["chunk"]) == (4096, 64)
    asked = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "max_seq_len": "256", "chunk": "16"}, store).options
    assert (asked["max_seq_len"], asked["chunk"]) == (256, 16)


def _config_only_checkpoint(folder, **changes):
    """A checkpoint folder with only its config.json: resolving the options reads nothing else."""
    from cudabuild.models import qwen_moe, qwen_moe_hf

    folder.mkdir()
    config = qwen_moe_hf.hf_config(qwen_moe.SIZES["tiny"])
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_qwen_moe_lengths_come_from_the_checkpoint_capped(store, tmp_path):
    long = _config_only_checkpoint(tmp_path / "long", max_position_embeddings=262_144)
    options = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(long)}, store).options
    assert (options["max_seq_len"], options["chunk"]) == (4096, 64)  # not the tiny size's 128 and 8
    short = _config_only_checkpoint(tmp_path / "short", max_position_embeddings=256)
    options = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(short)}, store).options
    assert (options["max_seq_len"], options["chunk"]) == (256, 64)
    with pytest.raises(InvalidOption, match=r"^qwen_moe option max_seq_len=512: the checkpoint's max_position_embeddings is 256$"):
        load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(short), "max_seq_len": "512"}, store)


def test_a_checkpoint_config_the_model_cannot_follow_is_refused_before_anything_runs(store, tmp_path):
    folder = _config_only_checkpoint(tmp_path / "ckpt", attention_bias=True)
    with pytest.raises(CudabuildError) as info:
        load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(folder)}, store)
    assert str(info.value) == (f"{folder}/config.json: attention_bias=true is not supported; "
                               "supported: false (no bias on the attention projections)")


def test_resolved_options_are_memoised_so_a_second_load_imports_no_torch(tmp_path):
    probe = (
        "import sys; from pathlib import Path; from cudabuild.config import load_config;"
        "from cudabuild.engine.store import Store;"
        f"c = load_config(Path({str(REPO)!r}), {{'model': 'qwen_moe', 'target': 'cpu', 'layers': '2'}}, Store());"
        "print(sorted(c.options.items()), 'torch' in sys.modules)"
    )
    env = {"CUDABUILD_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    outputs = [r.stdout.strip() for r in runs]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    expected = "[('checkpoint', ''), ('chunk', 8), ('layers', 2), ('max_seq_len', 128), ('seed', 0), ('size', 'tiny')]"
    assert outputs == [f"{expected} True", f"{expected} False"]


def test_a_bad_recipe_option_stops_doit_export_with_status_2_before_probe(project):
    result = project.export("model=qwen_moe", "target=cpu", "size=huge", "layers=x")
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    errors = [line for line in text.splitlines() if line.startswith("cudabuild: error: ")]
    for problem in ("qwen_moe option size=huge: expected one of tiny, 35b-a3b (default tiny)",
                    "qwen_moe option layers=x: expected an integer (default 0)"):
        assert any(problem in line for line in errors), text
    assert "Traceback" not in text and "probe" not in text
    assert not (project.root / "build" / "qwen_moe").exists()

"""Tests for cudabuild/config.py: one build's settings merged once, every problem reported together,
recipe options checked (type, range, choices, target) and resolved (qwen_moe's max_seq_len and
chunk, a checkpoint's config.json and tensors) up front; and, end to end, that each class of bad
input stops `doit export` with one line on stderr and exit status 2 before any stage starts,
leaving build/ as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from cudabuild.config import InvalidConfig, load_config
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
        "qwen_moe option layers=x: expected an integer >= 0 (default 0: every layer)",
        "qwen_moe option size=huge: expected one of tiny, 35b-a3b (default tiny)",
        "qwen_moe option checkpoint=/no/such/dir: no such folder",
        "autotune=always: expected auto or pin",
    ]


def test_an_option_of_the_other_target_is_refused_with_the_reason(store):
    assert problems(store, model="qwen_moe", target="cuda", chunk="8", layers="-3") == [
        "qwen_moe option chunk=8 applies to target cpu only, not cuda; drop it for target=cuda",
        "qwen_moe option layers=-3: expected an integer >= 0 (default 0: every layer)",
    ]
    assert problems(store, model="qwen_moe", target="cpu", qlinear="8w") == [
        "qwen_moe option qlinear=8w applies to target cuda only, not cpu; drop it for target=cpu"]


def test_what_resolve_refuses_comes_with_the_options_problems(store):
    """A value with a problem is left at its default for resolve, which reports its own beside."""
    assert problems(store, model="qwen_moe", target="cpu", size="huge", layers="9") == [
        "qwen_moe option size=huge: expected one of tiny, 35b-a3b (default tiny)",
        "qwen_moe option layers=9: the size tiny has 4",
    ]


def test_qwen_moe_lengths_come_from_the_size_and_are_in_the_options(store):
    assert dict(load_config(REPO, {"model": "qwen_moe", "target": "cpu"}, store).options) == {
        "size": "tiny", "layers": 0, "checkpoint": "", "seed": 42, "max_seq_len": 64, "chunk": 8}
    sized = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "size": "35b-a3b", "layers": "2"}, store).options
    assert (sized["max_seq_len"], sized["chunk"]) == (4096, 64)
    asked = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "max_seq_len": "256", "chunk": "16"}, store).options
    assert (asked["max_seq_len"], asked["chunk"]) == (256, 16)
    cuda = load_config(REPO, {"model": "qwen_moe", "target": "cuda"}, store).options
    assert cuda["max_seq_len"] == 64 and "chunk" not in cuda  # one resolve, the same size table


def tiny_checkpoint(folder, edit=None, **changes):
    """A real checkpoint of the tiny qwen_moe (random weights, Hugging Face names and layout), its
    config.json's fields changed by `changes`; `edit(tensors)` may change its tensors first."""
    import _qwen35_moe_hf as qwen35_moe_hf

    qwen35_moe_hf.save(folder, edit=edit)
    qwen35_moe_hf.write_config(folder, qwen35_moe_hf.config_json(**changes))  # fields the tensors do not follow
    return folder


def test_qwen_moe_lengths_come_from_the_checkpoint_capped(store, tmp_path):
    long = tiny_checkpoint(tmp_path / "long", max_position_embeddings=262_144)
    options = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(long)}, store).options
    assert (options["max_seq_len"], options["chunk"]) == (4096, 64)  # not the tiny size's 64 and 8
    short = tiny_checkpoint(tmp_path / "short", max_position_embeddings=256)
    options = load_config(REPO, {"model": "qwen_moe", "target": "cpu", "checkpoint": str(short)}, store).options
    assert (options["max_seq_len"], options["chunk"]) == (256, 64)
    assert problems(store, model="qwen_moe", target="cpu", checkpoint=str(short), max_seq_len="512") == [
        "qwen_moe option max_seq_len=512: the checkpoint's max_position_embeddings is 256"]


def test_a_checkpoint_config_the_model_cannot_follow_is_refused_before_anything_runs(store, tmp_path):
    folder = tiny_checkpoint(tmp_path / "ckpt", attention_bias=True)
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
    runs = [subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    outputs = [r.stdout.strip() for r in runs]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    expected = "[('checkpoint', ''), ('chunk', 8), ('layers', 2), ('max_seq_len', 64), ('seed', 42), ('size', 'tiny')]"
    assert outputs == [f"{expected} True", f"{expected} False"]


def test_a_checkpoints_check_is_memoised_by_its_headers_so_a_touch_imports_no_torch(tmp_path):
    """The check of a checkpoint's config.json and tensors is keyed by the files' headers: a second
    load, and one after a shard was touched, import no torch; a shard rewritten with another shape
    is checked again, and refused."""
    folder = tiny_checkpoint(tmp_path / "ckpt")
    probe = (
        "import sys; from pathlib import Path; from cudabuild.config import load_config;"
        "from cudabuild.engine.store import Store; from cudabuild.errors import InvalidConfig\n"
        f"try: c = load_config(Path({str(REPO)!r}), {{'model': 'qwen_moe', 'target': 'cpu', 'checkpoint': {str(folder)!r}}}, "
        "Store()); print(c.options['max_seq_len'], 'torch' in sys.modules)\n"
        "except InvalidConfig as e: print(e.problems)"
    )
    env = {"CUDABUILD_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}

    def load() -> str:
        done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert [load(), load()] == ["64 True", "64 False"]
    os.utime(folder / "model.safetensors")
    assert load() == "64 False"

    def narrower(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:200].clone()

    shutil.rmtree(folder)
    tiny_checkpoint(folder, edit=narrower)
    assert load() == str([f"tensor 'lm_head.weight' in {folder}/model.safetensors has shape [200, 128], "
                          "config.json implies [256, 128]"])


# -- each class of bad input, end to end: `doit export` in a project with a finished build ----------


def tree(root) -> dict:
    """Every file under root, hidden ones (stamps, trace parts) included: its size, mtime and sha256."""
    import hashlib

    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(built_tiny, tmp_path_factory):
    """A copy of the run's tiny_lm build: build/ holds its outputs, stamps, logs and trace."""
    return built_tiny.copy(tmp_path_factory.mktemp("bad-input"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Real tiny checkpoints, one per class of damage (written by tests/_checkpoint.py)."""
    import torch

    from cudabuild.formats.safetensors_parts import read_raw_header

    root = tmp_path_factory.mktemp("checkpoints")
    good = tiny_checkpoint(root / "good")
    for name in ("a-list", "banana", "no-heads", "no-safetensors", "truncated"):
        shutil.copytree(good, root / name)
    (root / "a-list" / "config.json").write_text("[1, 2, 3]")
    config = json.loads((good / "config.json").read_text())
    (root / "banana" / "config.json").write_text(json.dumps(dict(config, hidden_size="banana")))
    (root / "no-heads" / "config.json").write_text(json.dumps(dict(config, num_attention_heads=0)))
    (root / "no-safetensors" / "model.safetensors").unlink()
    shard = root / "truncated" / "model.safetensors"
    _, start, size = read_raw_header(shard)
    os.truncate(shard, start + (size - start) // 2)

    def narrower(tensors):
        name = "model.language_model.layers.0.mlp.gate.weight"
        tensors[name] = tensors[name][:7].clone()

    tiny_checkpoint(root / "shape", edit=narrower)

    def half(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float16)

    tiny_checkpoint(root / "dtype", edit=half)
    return root


GATE = "model.language_model.layers.0.mlp.gate.weight"
BAD_INPUT = [
    # (id, settings, the one error line; {ckpt}: the checkpoint folder of that id)
    ("option-range", ["model=qwen_moe", "layers=-3"], "qwen_moe option layers=-3: expected an integer >= 0 (default 0: every layer)"),
    ("option-type", ["model=tiny_lm", "seed=x"], "tiny_lm option seed=x: expected an integer >= 0 (default 0)"),
    ("option-choice", ["model=qwen_moe", "size=huge"], "qwen_moe option size=huge: expected one of tiny, 35b-a3b (default tiny)"),
    ("option-target", ["model=qwen_moe", "target=cuda", "chunk=8"],
     "qwen_moe option chunk=8 applies to target cpu only, not cuda; drop it for target=cuda"),
    ("unknown-setting", ["model=tiny_lm", "sed=1"], "unknown setting 'sed' for model tiny_lm; did you mean seed=?; "
     "recipe options: layers, seed; specs: autotune_at_compile_time, autotune_pointwise, compile_wrapper_opt_level, "
     "coordinate_descent_tuning, emulate_precision_casts, low_memory_mode, max_autotune, platform, shim_library_path, "
     "triton_kernel_mode (or METHOD.SPEC)"),
    # With no model= the default's options are the ones looked in; a typo of model is named as one.
    ("model-typo", ["modle=tiny_lm"], "unknown setting 'modle' for model qwen_moe (the default: no model= given); did "
     "you mean model=?; recipe options: checkpoint, chunk, layers, max_seq_len, seed, size; specs: "),
    ("given-twice", ["model=tiny_lm", "layers=1", "layers=3"], "layers=1 layers=3: layers is given 2 values; give layers once"),
    ("resolve", ["model=qwen_moe", "max_seq_len=3"],
     "qwen_moe option max_seq_len=3: expected an integer >= 4 (default 0: from the checkpoint or the size)"),
    ("no-folder", ["model=qwen_moe", "checkpoint={ckpt}"], "qwen_moe option checkpoint={ckpt}: no such folder"),
    ("a-list", ["model=qwen_moe", "checkpoint={ckpt}"],
     "{ckpt}/config.json: not a JSON object (a Hugging Face config.json is one), but a list"),
    ("banana", ["model=qwen_moe", "checkpoint={ckpt}"],
     "{ckpt}/config.json: hidden_size='banana' is not an integer; expected an integer >= 1"),
    ("no-heads", ["model=qwen_moe", "target=cuda", "checkpoint={ckpt}"],
     "{ckpt}/config.json: num_attention_heads=0 is out of range; expected an integer >= 1"),
    ("no-safetensors", ["model=qwen_moe", "checkpoint={ckpt}"],
     "{ckpt}: no .safetensors file; expected model.safetensors.index.json with shards, or one model.safetensors"),
    ("truncated", ["model=qwen_moe", "checkpoint={ckpt}"], "{ckpt}/model.safetensors: truncated safetensors file: "),
    ("shape", ["model=qwen_moe", "checkpoint={ckpt}"],
     "tensor '" + GATE + "' in {ckpt}/model.safetensors has shape [7, 128], config.json implies [8, 128]"),
    ("dtype", ["model=qwen_moe", "target=cuda", "checkpoint={ckpt}"],
     "tensor 'lm_head.weight' in {ckpt}/model.safetensors is F16, config.json's dtype float32 implies F32"),
]


@pytest.mark.parametrize("settings, line", [pytest.param(s, line, id=i) for i, s, line in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_before_any_stage_and_build_is_untouched(finished, checkpoints, request, settings, line):
    case = request.node.callspec.id
    ckpt = checkpoints / case
    args = [a.format(ckpt=ckpt) for a in settings]
    if not any(a.startswith("target=") for a in args):
        args.append("target=cpu")
    before = tree(finished.root / "build")
    done = finished.export(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    expected = "cudabuild: error: " + line.format(ckpt=ckpt)
    errors = done.stderr.splitlines()
    assert len(errors) == 1 and (errors[0] == expected or expected.endswith(": ") and errors[0].startswith(expected)), \
        (errors, expected)
    assert done.stdout == "" and "Traceback" not in done.stderr  # nothing started: no progress line, no stage
    assert tree(finished.root / "build") == before  # no stamp, log, trace part or output written, none removed

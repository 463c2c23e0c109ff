"""The export stage's eager models: every method of a build exports the same module, and a
process keeps only the latest model, so a nightly over many models does not hold them all."""

from pathlib import Path
from types import SimpleNamespace

import torch

from cudabuild.backend.stages.export import build_model
from cudabuild.config import BuildConfig

REPO = Path(__file__).resolve().parents[1]


def stage_context(seed: int) -> SimpleNamespace:
    """What build_model reads of a stage's context: the build's config (tiny_lm, from this repo),
    the recipe's form it loads, and the stage's key inputs (no quantize stage's digest: tiny_lm
    builds its model itself)."""
    config = BuildConfig(project=REPO, model="tiny_lm", target="cpu", options={"seed": seed, "layers": 2},
                         specs={}, description={})
    return SimpleNamespace(config=config, recipe=config.recipe, inputs={})


def test_methods_share_the_model_and_a_new_model_replaces_the_last():
    _, first, _ = build_model(stage_context(0))
    assert build_model(stage_context(0))[1] is first  # the next method exports the same module

    _, other, _ = build_model(stage_context(1))
    assert other is not first

    _, again, _ = build_model(stage_context(0))
    assert again is not first  # dropped when seed=1 was built: rebuilt, with the same weights
    assert build_model(stage_context(0))[1] is again
    first_weights, again_weights = first.state_dict(), again.state_dict()
    assert first_weights.keys() == again_weights.keys()
    assert all(torch.equal(first_weights[k], again_weights[k]) for k in first_weights)

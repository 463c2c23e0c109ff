"""The export stage (cudabuild.backend.stages.export) and the eager models it and the trace stage
build (cudabuild.backend.eager_model).

Every method takes the same module, and a process keeps only the latest. New weights for the same
code (another seed) trace nothing: the trace stage is cached, and export binds the new model's
weights into the traced program by FQN, giving a .pte and .ptd byte-identical to a cold build of
those weights, for tiny_lm and qwen_moe's CPU form (real builds). Where the traced program cannot
take the new model's weights (a weight of another layout, a constant that follows the seed), export
says why and traces them, and gives what a cold export gives."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import Project, assert_ok, new_project

from cudabuild.backend.eager_model import build_model
from cudabuild.config import BuildConfig
from cudabuild.models.tiny_lm import TinyConfig
from cudabuild.registry import load_recipe

REPO = Path(__file__).resolve().parents[1]
TINY = ("model=tiny_lm", "target=cpu")
QWEN = ("model=qwen_moe", "target=cpu")
OUTPUTS = ("model.pte", "aoti_cpu_blob.ptd")
VOCAB, DIM = TinyConfig().vocab_size, TinyConfig().dim


def stage_context(seed: int) -> SimpleNamespace:
    """What build_model reads of a stage's context: the build's config (tiny_lm, from this repo),
    the recipe's form it loads, and the checkpoint's digest (none: tiny_lm draws its weights)."""
    options = load_recipe(REPO, "tiny_lm").defaults("cpu").replace(seed=seed, layers=2)
    config = BuildConfig(project=REPO, model="tiny_lm", target="cpu", options=options, specs={}, description={})
    return SimpleNamespace(config=config, recipe=config.recipe, inputs={}, checkpoint_digest=lambda: None)


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


# -- new weights, end to end ---------------------------------------------------------------------


def outputs(project: Project, model: str) -> dict[str, str]:
    folder = project.root / "build" / model / "cpu"
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in OUTPUTS}


def stamp(project: Project, model: str, stage: str) -> dict:
    return json.loads((project.root / "build" / model / "cpu" / ".stamps" / f"{stage}.json").read_text())


def assert_bound_not_traced(project: Project, model: str, result) -> None:
    """The build traced, lowered and compiled nothing, and export bound the new weights."""
    statuses = project.statuses(model)
    for m in ("decode", "prefill"):
        assert (statuses[f"trace.{m}"], statuses[f"edge.{m}"], statuses[f"compile.{m}"]) == ("cached",) * 3, statuses
        assert statuses[f"export.{m}"] == "ran"
        assert stamp(project, model, f"export.{m}")["value"]["weights"] == "bound"
    assert "weights bound, program as traced" in result.stdout  # the summary says it
    assert project.manifest(model)["verify"]["decode"]["passed"] and project.manifest(model)["verify"]["prefill"]["passed"]


@pytest.mark.slow
def test_a_new_seed_binds_its_weights_into_the_trace_and_gives_a_cold_builds_bytes(tiny_copy, cold_seed_1):
    said = tiny_copy.explain("seed=1")
    assert said["trace.decode"] == said["trace.prefill"] == "up to date (the new weights do not change it: option seed: 0 -> 1)"
    assert said["export.decode"] == "will run for the new weights (option seed: 0 -> 1): binds them into the traced program"
    result = tiny_copy.export(*TINY, "seed=1")
    assert_ok(result)
    assert_bound_not_traced(tiny_copy, "tiny_lm", result)
    assert outputs(tiny_copy, "tiny_lm") == outputs(cold_seed_1, "tiny_lm")
    for m in ("decode", "prefill"):  # the program a trace of these weights gives, and so the same keys after it
        bound, traced = stamp(tiny_copy, "tiny_lm", f"export.{m}"), stamp(cold_seed_1, "tiny_lm", f"export.{m}")
        assert (bound["digest"], bound["value"]["facets"]) == (traced["digest"], traced["value"]["facets"])
        # Every file a trace of these weights writes, byte for byte (the serialised graph but in
        # another project: its stack traces name the source's paths).
        assert {k: v for k, v in bound["outputs"].items() if k != "program.json"} == {
            k: v for k, v in traced["outputs"].items() if k != "program.json"}
        assert traced["value"]["weights"] == "as traced"  # the cold build's export handed its trace on


@pytest.mark.slow
def test_a_new_seed_of_qwen_moe_on_the_cpu_traces_nothing_and_gives_a_cold_builds_bytes(built_qwen_cpu,
                                                                                        cold_qwen_cpu_seed_7, tmp_path):
    project = built_qwen_cpu.copy(tmp_path)
    result = project.export(*QWEN, "seed=7")
    assert_ok(result)
    assert_bound_not_traced(project, "qwen_moe", result)
    assert outputs(project, "qwen_moe") == outputs(cold_qwen_cpu_seed_7, "qwen_moe")


# -- where the traced program cannot take the new weights ------------------------------------------

# tiny_lm's recipe, edited so that seed 1 gives a model the seed-0 trace does not fit, though the
# recipe still declares `seed` as changing the weights' values alone.
MISFITS = {
    # A weight of the same shape, transposed in memory: other strides, so other compiled code.
    "layout": ("    return TinyLM(TinyConfig(n_layers=options.layers)).eval()",
               "    model = TinyLM(TinyConfig(n_layers=options.layers)).eval()\n"
               "    if options.seed == 1:\n"
               "        model.embed.weight = torch.nn.Parameter(model.embed.weight.detach().t().contiguous().t())\n"
               "    return model"),
    # A non-persistent buffer drawn from the seed: a constant of the program that follows the weights.
    "constant": ("    return TinyLM(TinyConfig(n_layers=options.layers)).eval()",
                 "    model = ShiftedLM(TinyConfig(n_layers=options.layers)).eval()\n"
                 "    model.register_buffer(\"shift\", torch.randn(4), persistent=False)\n"
                 "    return model\n\n\n"
                 "class ShiftedLM(TinyLM):\n"
                 "    def forward(self, tokens, input_pos):\n"
                 "        return super().forward(tokens, input_pos) + self.shift[0]"),
}
WHY = {
    "layout": "export.decode: weight embed.weight has stride [1, {rows}] in this build's model, [{cols}, 1] in the traced "
              "program; tracing these weights",
    "constant": "export.decode: constant shift of the traced program differs from this build's model's (a buffer or "
                "tensor attribute that follows the weights, not the code); tracing these weights",
}


def misfit_project(folder: Path, misfit: str) -> Project:
    project = new_project(folder)
    recipe = project.root / "recipes" / "tiny_lm.py"
    old, new = MISFITS[misfit]
    assert old in recipe.read_text()
    recipe.write_text(recipe.read_text().replace(old, new))
    return project


@pytest.mark.slow
@pytest.mark.parametrize("misfit", sorted(MISFITS))
def test_weights_the_traced_program_cannot_take_are_traced_with_the_reason(tmp_path, misfit):
    project = misfit_project(tmp_path / "built", misfit)
    assert_ok(project.doit("export:export.decode", *TINY))  # the trace of seed 0, and what it needs
    traced = stamp(project, "tiny_lm", "trace.decode")
    result = project.doit("export:export.decode", *TINY, "seed=1")
    assert_ok(result)
    said = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("export.decode:")]
    expected = WHY[misfit].format(rows=VOCAB, cols=DIM)  # tiny_lm's embedding: [VOCAB, DIM]
    assert said == [expected], result.stdout
    assert stamp(project, "tiny_lm", "trace.decode") == traced  # seed 0's trace, found for seed 1
    mine = stamp(project, "tiny_lm", "export.decode")
    assert mine["value"]["weights"] == "traced" and mine["value"]["why"] == expected.removeprefix(
        "export.decode: ").removesuffix("; tracing these weights")
    # What a cold export of seed 1 gives: its graph, weights, constants and code.
    cold = misfit_project(tmp_path / "cold", misfit)
    assert_ok(cold.doit("export:export.decode", *TINY, "seed=1"))
    theirs = stamp(cold, "tiny_lm", "export.decode")
    assert (mine["digest"], mine["value"]["facets"]) == (theirs["digest"], theirs["value"]["facets"])
    assert mine["digest"] != traced["digest"]

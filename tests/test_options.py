"""Tests for cudabuild/options.py: a recipe's option table, and the one check of the command line's
values against it (type, range, choices, folder, target), every problem collected."""

from __future__ import annotations

import pytest

from cudabuild import options as opt
from cudabuild.options import Option
from conftest import REPO

TABLE = (
    Option("size", "tiny", choices=("tiny", "big")),
    Option("layers", 0, minimum=0, meaning={0: "every layer"}),
    Option("scale", 1.5, minimum=0.5, maximum=4),
    Option("fast", False),
    Option("checkpoint", "", folder=True),
    Option("chunk", 0, minimum=0, targets=("cpu",)),
    Option("qlinear", "4w", choices=("4w", "8w"), targets=("cuda",)),
)


def check(target="cpu", **given):
    return opt.check("m", target, TABLE, given)


def test_values_take_the_options_type_and_defaults_fill_the_rest():
    values, problems = check(layers="3", scale="2", fast="ON", size="big")
    assert problems == []
    assert values == {"size": "big", "layers": 3, "scale": 2.0, "fast": True, "checkpoint": "", "chunk": 0}
    assert check("cuda")[0] == {"size": "tiny", "layers": 0, "scale": 1.5, "fast": False, "checkpoint": "", "qlinear": "4w"}


def test_every_problem_is_one_line_naming_the_option_what_it_takes_and_its_default(tmp_path):
    _, problems = check(layers="-3", scale="9", fast="maybe", size="huge", checkpoint=str(tmp_path / "nope"), chunk="x")
    assert problems == [
        "m option layers=-3: expected an integer >= 0 (default 0: every layer)",
        "m option scale=9: expected a number from 0.5 to 4 (default 1.5)",
        "m option fast=maybe: expected true or false (default false)",
        "m option size=huge: expected one of tiny, big (default tiny)",
        f"m option checkpoint={tmp_path / 'nope'}: no such folder",
        "m option chunk=x: expected an integer >= 0 (default 0)",
    ]
    assert check(checkpoint=str(tmp_path))[1] == []


def test_a_file_given_for_a_folder_says_so_and_names_the_folder_it_is_in(tmp_path):
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"")
    assert check(checkpoint=str(shard))[1] == [
        f"m option checkpoint={shard}: is a file; expected the checkpoint's folder (this file's is {tmp_path})"]


@pytest.mark.parametrize("raw", ["3.5", "", "1e3", "true", "nan"])
def test_an_integer_option_takes_whole_numbers_only(raw):
    assert check(layers=raw)[1] == [f"m option layers={raw or chr(39) * 2}: expected an integer >= 0 (default 0: every layer)"]


def test_an_option_of_another_target_is_refused_with_the_reason():
    assert check("cuda", chunk="8")[1] == ["m option chunk=8 applies to target cpu only, not cuda; drop it for target=cuda"]
    assert check("cpu", qlinear="8w")[1] == ["m option qlinear=8w applies to target cuda only, not cpu; drop it for target=cpu"]
    # An unknown target (reported by the caller): the values are still checked, the targets not.
    assert check(None, qlinear="2w")[1] == ["m option qlinear=2w: expected one of 4w, 8w (default 4w)"]


def test_a_value_is_shown_with_what_it_means():
    assert opt.shown_values(TABLE, {"layers": 0, "fast": False, "scale": 2.0}) == {
        "layers": "0 (every layer)", "fast": "false", "scale": "2"}
    assert opt.shown_values(TABLE, {"layers": 4})["layers"] == "4"


def test_a_plain_mapping_is_a_table_of_its_defaults_types_and_a_name_is_declared_once():
    assert opt.table({"seed": 0}) == (Option("seed", 0),)
    assert opt.check("m", "cpu", opt.table({"seed": 0}), {"seed": "-4"}) == ({"seed": -4}, [])
    with pytest.raises(ValueError, match="options declared twice: seed"):
        opt.table([Option("seed", 0), Option("seed", 1)])


def test_an_option_names_its_targets_or_is_refused_when_declared():
    """recipes/qwen_moe.py once bound CUDA = ("cuda",) for its table, then CUDA = Recipe(...): an
    option declared after that with targets=CUDA would have applied to no target at all."""
    from cudabuild.recipe import Recipe

    form = Recipe(build=None, methods=())
    for targets in (form, "cuda", ["cuda"]):
        with pytest.raises(ValueError, match="option qlinear: targets must be a tuple of target names such as"):
            Option("qlinear", "4w", targets=targets)


def test_the_table_survives_the_description_memo_as_data():
    assert tuple(Option.from_data(o.as_data()) for o in TABLE) == TABLE
    hub = Option("checkpoint", "", folder=True, hub=True, help="a folder or its Hub id")
    assert Option.from_data(hub.as_data()) == hub
    assert hub.expected() == "an existing folder or a Hugging Face Hub id ORG/NAME[@REVISION] (or '' for none) (default '')"


def test_every_recipe_declares_every_option_with_a_type_and_a_range_or_choices():
    """The recipes' own tables: every integer or number bounded below, every string a folder or
    one of its choices (a free string would be a value nobody checks)."""
    from cudabuild.registry import list_models, load_recipe

    for model in list_models(REPO):
        recipe = load_recipe(REPO, model)
        for form in [recipe, *recipe.targets.values()]:
            for option in opt.table(form.options):
                where = f"{model} option {option.name}"
                if option.kind in (int, float):
                    assert option.minimum is not None or option.choices, where
                elif option.kind is str:
                    assert option.folder or option.choices, where


def test_a_name_given_two_values_is_one_problem_and_the_same_value_twice_none():
    assert opt.given_twice([("layers", "1"), ("seed", "0"), ("layers", "3"), ("layers", "1")]) == [
        "layers=1 layers=3: layers is given 2 values; give layers once"]
    assert opt.given_twice([("layers", "3"), ("layers", "3")]) == []


def test_closest_names_what_a_typo_meant_and_nothing_for_a_stranger():
    assert opt.closest("modle", ["model", "target", "layers"]) == "model"
    assert opt.closest("max_autotun", ["max_autotune", "low_memory_mode"]) == "max_autotune"
    assert opt.closest("banana", ["model", "target", "layers"]) is None

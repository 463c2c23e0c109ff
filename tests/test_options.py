"""Tests for cudabuild/options.py: a recipe's option table, the one check of the command line's
values against it (type, range, choices, folder, target), every problem collected, and the typed
object it makes, which the models read by attribute."""

from __future__ import annotations

import ast
import pickle

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


def test_the_parser_makes_one_typed_object_of_the_table():
    values, problems = check(layers="3", fast="on")
    assert problems == [] and isinstance(values, opt.Options)
    assert (values.layers, values.fast, values.scale, values.size, values.chunk) == (3, True, 1.5, "tiny", 0)
    assert values.qlinear is None  # a row of another target: not this build's, not in its keys
    assert list(values) == ["size", "layers", "scale", "fast", "checkpoint", "chunk"]  # the table's order
    with pytest.raises(AttributeError, match="'layer' is not an option of this recipe"):
        values.layer  # noqa: B018  (a typo of a model reading its options fails, where it is)
    with pytest.raises(AttributeError, match="not changed in place"):
        values.layers = 4
    again = values.replace(layers=5)
    assert (again.layers, values.layers) == (5, 3) and again != values
    with pytest.raises(KeyError, match="not options of this build: qlinear"):
        values.replace(qlinear="8w")
    assert pickle.loads(pickle.dumps(values)) == values and pickle.loads(pickle.dumps(values)).layers == 3


def test_what_an_option_decides_by_itself_is_a_row_of_the_table():
    table = opt.table([Option("bundle", "", folder=True), Option("bits", 4, minimum=1, decided_by="bundle"),
                       Option("seed", 0, minimum=0)])
    assert opt.Options(table, {"bundle": "/b", "bits": 8, "seed": 1}).decided() == {"bundle": (["bits"], ["bits=8"])}
    assert opt.Options(table, {"bundle": "/b", "bits": 4, "seed": 1}).decided() == {"bundle": (["bits"], [])}
    assert opt.Options(table, {"bundle": "", "bits": 8, "seed": 1}).decided() == {}
    with pytest.raises(ValueError, match="option bits: decided_by=nothing names no option of the table"):
        opt.table([Option("bits", 4, decided_by="nothing")])
    with pytest.raises(ValueError, match="option weights: checkpoint=True needs folder=True"):
        opt.table([Option("weights", "", checkpoint=True)])
    with pytest.raises(ValueError, match="option items: its name is one of the options object's own"):
        opt.table([Option("items", 0)])


def _reads_of_options(path):
    """(`NAME` of each `options.NAME` read, each `options["NAME"]` or `options.get("NAME")`) in a file."""
    read, by_string = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "options":
            read.add(node.attr)
        target = node.value if isinstance(node, ast.Subscript) else (
            node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            else None)
        if isinstance(target, ast.Name) and target.id == "options":
            key = node.slice if isinstance(node, ast.Subscript) else (node.args[0] if node.args else None)
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                by_string.append(f"{path.name}:{node.lineno}: options[{key.value!r}]")
    return read, by_string


def test_every_option_a_recipe_or_model_reads_is_a_row_of_the_recipes_table():
    """No option name travels as a string outside the table: a recipe and the models it imports (its
    sources) read a build's options as attributes of the typed object (`options.layers`), each the
    name of a row of that recipe's table, never by a string (`options["layers"]`). What the build
    does with an option (the quantize stage's key, a seed's values alone, the checkpoint, what a
    bundle decides) is a property of its row, checked when the table is made."""
    from cudabuild.registry import list_models, load_recipe, source_files

    api = {name for name in dir(opt.Options) if not name.startswith("_")}
    for model in list_models(REPO):
        recipe = load_recipe(REPO, model)
        rows = {o.name for form in [recipe, *recipe.targets.values()] for o in opt.table(form.options)}
        read, by_string = set(), []
        for path in source_files(REPO, model):
            parts = path.relative_to(REPO).parts
            if parts[0] == "recipes" or parts[:2] == ("cudabuild", "models"):
                found = _reads_of_options(path)
                read |= found[0]
                by_string += found[1]
        assert read - api, f"{model}: no option read found; the scan is blind"
        assert read - api <= rows, f"{model} reads options its table does not have: {sorted(read - api - rows)}"
        assert not by_string, by_string


def test_a_name_given_two_values_is_one_problem_and_the_same_value_twice_none():
    assert opt.given_twice([("layers", "1"), ("seed", "0"), ("layers", "3"), ("layers", "1")]) == [
        "layers=1 layers=3: layers is given 2 values; give layers once"]
    assert opt.given_twice([("layers", "3"), ("layers", "3")]) == []


def test_closest_names_what_a_typo_meant_and_nothing_for_a_stranger():
    assert opt.closest("modle", ["model", "target", "layers"]) == "model"
    assert opt.closest("max_autotun", ["max_autotune", "low_memory_mode"]) == "max_autotune"
    assert opt.closest("banana", ["model", "target", "layers"]) is None

"""One build's configuration, merged once from the command line and the recipe, then frozen.

Owns that merge and its one report of every problem (BuildConfig, load_config). Must not touch:
torch (a no-op build configures without it: the recipe's description and resolve come memoised
through cudabuild.registry), a stage, the keys (cudabuild.pipeline composes them from the config).

`doit export model=NAME target=cpu size=tiny max_autotune=ON decode.low_memory_mode=ON`:
`model` and `target` pick the build; a spec key (or `METHOD.KEY`) overrides a compile spec; any
other name must be one of the recipe's options (its table: cudabuild/options.py, which checks
type, range, choices and target). A folder option that takes a Hugging Face Hub id is given the
snapshot folder the id resolves to (cudabuild.hub). Then the recipe's `resolve` fills in what follows from them and
checks what they name (a checkpoint's config.json and its tensors' headers). Every problem is
reported at once (InvalidConfig, one line per problem), before anything runs or enters the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from cudabuild import hub, registry
from cudabuild import options as option_table
from cudabuild.errors import CudabuildError, InvalidConfig, InvalidOption, UnknownTarget, compose
from cudabuild.specs import SPEC_TABLE, merge_method_specs
from cudabuild.backend.toolchain import resolve_target
from cudabuild.engine.graph import Pipeline
from cudabuild.pipeline import PIPELINE

DEFAULT_MODEL = "qwen_moe"
RESERVED = ("model", "target", "models", "targets", "autotune")


@dataclass(frozen=True)
class BuildConfig:
    """One build, as the engine takes it (cudabuild.engine.graph.Build) and more: the recipe's
    description, the target's note, the autotune mode."""

    project: Path
    model: str
    target: str
    options: option_table.Options  # typed: an attribute per row of the recipe's table (a mapping too)
    specs: Mapping[str, Mapping[str, str]]  # method -> {key: value}
    description: Mapping[str, Any]
    target_note: Optional[str] = None
    autotune: str = "auto"  # auto | pin (write recipes/<model>.autotune.json)
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Where build/<model>/<target>/ lives: the project's build/, or a cluster worker's own folder
    # (cudabuild.cluster_worker), so that a worker never writes into a driver's build/.
    build_root: Optional[Path] = None
    # About how many bytes the build's weights take (the recipe's weights_bytes), or None.
    weights_bytes: Optional[int] = None

    @property
    def methods(self) -> list[str]:
        return list(self.description["methods"])

    @property
    def build_dir(self) -> Path:
        return (self.build_root or self.project / "build") / self.model / self.target

    @property
    def table(self) -> option_table.Table:
        """The recipe's option table, as its description holds it (no recipe imported)."""
        return option_table.table(option_table.Option.from_data(o) for o in self.description.get("option_table", ()))

    @property
    def checkpoint(self) -> Optional[Path]:
        """The folder the table's `checkpoint` option names, or None."""
        value = next((self.options.get(o.name) for o in self.table if o.checkpoint), None)
        return Path(value).expanduser().resolve() if value else None

    @property
    def shown_options(self) -> dict[str, str]:
        """The options' values as the console shows them, with what a value means where it says
        (`layers: 0 (every layer)`)."""
        return option_table.shown_values(self.table, self.options)

    @property
    def pipeline(self) -> Pipeline:
        return PIPELINE  # every build lowers through the one CUDA pipeline

    @property
    def recipe(self):
        """The recipe's form for this build's target (what its stages build from, through
        StageContext.recipe). Imports the recipe, and torch with it: a stage's business, never a
        no-op build's."""
        return registry.load_recipe(self.project, self.model).for_target(self.target)


def _hub_ids(model: str, target: Optional[str], table, given: Mapping[str, str], store) -> tuple[dict, list[str]]:
    """`given`, each Hugging Face Hub id of an option that takes one (`checkpoint=ORG/NAME[@REV]`)
    replaced by its snapshot folder in the Hub's cache (cudabuild.hub); a problem for each that
    cannot be, that option then left at its default. The build keys the folder by its content, so
    an id and the folder it resolves to are one build."""
    out, problems = dict(given), []
    for option in table:
        value = given.get(option.name)
        if not (option.hub and isinstance(value, str) and (target is None or option.applies_to(target))):
            continue
        if hub.parse(value) is None:
            continue  # a path: the table's check says whether it is a folder
        try:
            out[option.name] = str(hub.resolve(value, f"{model} option {option.name}={value}", store.actions))
        except CudabuildError as e:
            problems.append(str(e))
            del out[option.name]
    return out, problems


def load_config(project: Path, cli: Mapping[str, str], store, build_root: Optional[Path] = None) -> BuildConfig:
    """Merge the command line (`name=value` pairs) with the recipe's declarations.

    Every problem is collected (unknown names, options not of the target, option types, ranges
    and choices, specs, autotune, then what the recipe's `resolve` finds: combinations it cannot
    build, a checkpoint's config.json and tensors), then raised together as one InvalidConfig.
    """
    model = cli.get("model") or DEFAULT_MODEL
    problems: list[str] = []
    try:
        target, note = resolve_target(cli.get("target") or "auto")
    except UnknownTarget as e:
        target, note = None, None
        problems.append(str(e))
    # The recipe's form for the target (its options and methods); an unknown target's problem is
    # reported with the others, against the cpu form's options.
    description = registry.describe(project, model, store, target or "cpu")

    overrides: dict[str, str] = {}
    table = option_table.table(option_table.Option.from_data(o) for o in description["option_table"])
    known = {o.name for o in table}
    given: dict[str, str] = {}
    for name, value in cli.items():
        if name in RESERVED:
            continue
        key = name.rpartition(".")[2]
        if key in SPEC_TABLE:
            overrides[name] = value
        elif name in known:
            given[name] = value
        else:
            # A typo of `model` (or of anything else) is named; with no model= given, so is the
            # default whose options the name was looked up in.
            method = name.rpartition(".")[0]
            meant = option_table.closest(key, SPEC_TABLE if method else [*RESERVED, *known, *SPEC_TABLE])
            meant = f"{method}.{meant}" if method and meant else meant
            whose = f"model {model}" + ("" if cli.get("model") else " (the default: no model= given)")
            problems.append(compose(
                f"unknown setting '{name}' for {whose}" + (f"; did you mean {meant}=?" if meant else ""),
                fix=f"recipe options: {', '.join(option_table.names_for(table, target)) or 'none'}; "
                f"specs: {', '.join(sorted(SPEC_TABLE))} (or METHOD.SPEC)"))
    given, hub_problems = _hub_ids(model, target, table, given, store)
    problems.extend(hub_problems)
    options, option_problems = option_table.check(model, target, table, given)
    problems.extend(option_problems)

    specs: dict = {}
    weights_bytes = None
    if target is not None:
        specs, spec_problems = merge_method_specs(
            target, description["methods"], description["specs"], description["method_specs"], overrides
        )
        problems.extend(spec_problems)
    autotune = cli.get("autotune") or "auto"
    if autotune not in ("auto", "pin"):
        problems.append(compose(f"autotune={autotune}", expected="auto or pin"))
    if target is not None:
        # What the recipe makes of the options, and of the folders they name (a checkpoint's
        # config.json and tensors): checked beside the problems above (a value with a problem is
        # left at its default), so that every problem is reported in one go.
        try:
            options, weights_bytes = registry.resolved_build(project, description, options, store)
        except InvalidConfig as e:
            problems.extend(p for p in e.problems if p not in problems)
        except InvalidOption as e:
            problems.append(str(e))
    if problems:
        raise InvalidConfig(problems)
    return BuildConfig(project, model, target, options, specs, description, note, autotune, build_root=build_root,
                       weights_bytes=weights_bytes)


def model_note(project: Path, cli: Mapping[str, str]) -> Optional[str]:
    """What a build of the default model says on stderr (None where model= is given): a build
    must not be of a model the user did not name without a word."""
    if cli.get("model"):
        return None
    return f"model= not given: taking the default, model={DEFAULT_MODEL} (models: {', '.join(registry.list_models(project))})"


def load_reporting(found: list[str], project: Path, cli: Mapping[str, str], store, build_root: Optional[Path] = None) -> BuildConfig:
    """load_config, with the problems the caller `found` before it (the environment's, a setting
    given twice) reported in the same InvalidConfig as the settings', so that one run shows all."""
    try:
        config = load_config(project, cli, store, build_root)
    except InvalidConfig as e:
        raise InvalidConfig(found + [p for p in e.problems if p not in found]) from None
    except CudabuildError as e:  # an unknown model, a recipe that does not load
        if not found:
            raise
        raise InvalidConfig(found + [str(e)]) from None
    if found:
        raise InvalidConfig(found)
    return config

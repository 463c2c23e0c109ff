"""One build's configuration, merged once from the command line and the recipe, then frozen.

`doit export model=NAME target=cpu size=tiny max_autotune=ON decode.low_memory_mode=ON`:
`model` and `target` pick the build; a spec key (or `METHOD.KEY`) overrides a compile spec; any
other name must be one of the recipe's options. Every problem is reported at once (InvalidConfig,
one line per problem), before anything runs or enters the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from cudabuild import registry
from cudabuild.errors import InvalidOption, UnknownTarget
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
    options: Mapping[str, Any]
    specs: Mapping[str, Mapping[str, str]]  # method -> {key: value}
    description: Mapping[str, Any]
    target_note: Optional[str] = None
    autotune: str = "auto"  # auto | pin (write recipes/<model>.autotune.json)
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Where build/<model>/<target>/ lives: the project's build/, or a cluster worker's own folder
    # (cudabuild.cluster_worker), so that a worker never writes into a driver's build/.
    build_root: Optional[Path] = None

    @property
    def methods(self) -> list[str]:
        return list(self.description["methods"])

    @property
    def build_dir(self) -> Path:
        return (self.build_root or self.project / "build") / self.model / self.target

    @property
    def checkpoint(self) -> Optional[Path]:
        value = self.options.get("checkpoint")
        return Path(value).expanduser().resolve() if value else None

    @property
    def pipeline(self) -> Pipeline:
        return PIPELINE  # every build lowers through the one CUDA pipeline


class InvalidConfig(InvalidOption):
    """Every problem of one build's settings. `problems` holds one line each; str() joins them on
    one line, so a printer that shows one line still shows them all."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


_TYPES = {bool: "true or false", int: "an integer", float: "a number"}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "''" if value == "" else str(value)


def _coerce(model: str, name: str, default: Any, raw: str, choices: Optional[list] = None) -> Any:
    """`raw` as the type of the option's default; InvalidOption naming the model, the option, the
    type expected and the default."""
    kind = type(default)
    value: Any = str(raw)
    try:
        if kind is bool:
            lowered = str(raw).lower()
            if lowered not in ("1", "true", "on", "yes", "0", "false", "off", "no"):
                raise ValueError(raw)
            value = lowered in ("1", "true", "on", "yes")
        elif kind in (int, float):
            value = kind(raw)
    except ValueError:
        raise InvalidOption(f"{model} option {name}={raw}: expected {_TYPES[kind]} (default {_shown(default)})") from None
    if choices is not None and value not in choices:
        raise InvalidOption(f"{model} option {name}={raw}: expected one of {', '.join(map(str, choices))} "
                            f"(default {_shown(default)})")
    return value


def load_config(project: Path, cli: Mapping[str, str], store, build_root: Optional[Path] = None) -> BuildConfig:
    """Merge the command line (`name=value` pairs) with the recipe's declarations.

    Every problem is collected first (unknown names, option types and choices, specs, the
    checkpoint folder, autotune), then raised together as one InvalidConfig; the recipe's
    `resolve` runs only on settings without problems.
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
    defaults = description["options"]
    choices = description.get("choices", {})
    options = dict(defaults)
    for name, value in cli.items():
        if name in RESERVED:
            continue
        key = name.rpartition(".")[2]
        if key in SPEC_TABLE:
            overrides[name] = value
        elif name in options:
            try:
                options[name] = _coerce(model, name, defaults[name], value, choices.get(name))
            except InvalidOption as e:
                problems.append(str(e))
        else:
            problems.append(
                f"unknown setting '{name}' for model {model}; recipe options: {', '.join(sorted(options)) or 'none'}; "
                f"specs: {', '.join(sorted(SPEC_TABLE))} (or METHOD.SPEC)"
            )
    checkpoint = options.get("checkpoint")
    if checkpoint and not os.path.isdir(os.path.expanduser(checkpoint)):
        problems.append(f"checkpoint directory {checkpoint} does not exist")

    specs: dict = {}
    if target is not None:
        specs, spec_problems = merge_method_specs(
            target, description["methods"], description["specs"], description["method_specs"], overrides
        )
        problems.extend(spec_problems)
    autotune = cli.get("autotune") or "auto"
    if autotune not in ("auto", "pin"):
        problems.append(f"autotune={autotune}: expected auto or pin")
    if problems:
        raise InvalidConfig(problems)
    options = registry.resolve_options(project, description, options, store)
    return BuildConfig(project, model, target, options, specs, description, note, autotune, build_root=build_root)

"""One build's configuration, merged once from the command line and the recipe, then frozen.

`doit export model=NAME target=cpu size=tiny max_autotune=ON decode.low_memory_mode=ON`:
`model` and `target` pick the build; a spec key (or `METHOD.KEY`) overrides a compile spec; any
other name must be one of the recipe's options. Every problem is reported at once, on one line,
before anything runs or enters the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from cudabuild import registry
from cudabuild.errors import InvalidOption
from cudabuild.specs import SPEC_TABLE, resolve_method_specs
from cudabuild.backend.toolchain import resolve_target

DEFAULT_MODEL = "qwen_moe"
RESERVED = ("model", "target", "models", "targets", "autotune")


@dataclass(frozen=True)
class BuildConfig:
    project: Path
    model: str
    target: str
    options: Mapping[str, Any]
    specs: Mapping[str, Mapping[str, str]]  # method -> {key: value}
    description: Mapping[str, Any]
    target_note: Optional[str] = None
    autotune: str = "auto"  # auto | pin (write recipes/<model>.autotune.json)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def methods(self) -> list[str]:
        return list(self.description["methods"])

    @property
    def build_dir(self) -> Path:
        return self.project / "build" / self.model / self.target

    @property
    def checkpoint(self) -> Optional[Path]:
        value = self.options.get("checkpoint")
        return Path(value).expanduser().resolve() if value else None


def _coerce(name: str, default: Any, raw: str) -> Any:
    if isinstance(default, bool):
        if str(raw).lower() in ("1", "true", "on", "yes"):
            return True
        if str(raw).lower() in ("0", "false", "off", "no"):
            return False
        raise InvalidOption(f"option {name}={raw} is not a boolean (use true/false)")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise InvalidOption(f"option {name}={raw} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise InvalidOption(f"option {name}={raw} is not a number") from None
    return str(raw)


def load_config(project: Path, cli: Mapping[str, str], store) -> BuildConfig:
    """Merge the command line (`name=value` pairs) with the recipe's declarations."""
    model = cli.get("model") or DEFAULT_MODEL
    target, note = resolve_target(cli.get("target") or "auto")
    description = registry.describe(project, model, store)

    overrides: dict[str, str] = {}
    options = dict(description["options"])
    problems: list[str] = []
    for name, value in cli.items():
        if name in RESERVED:
            continue
        key = name.rpartition(".")[2]
        if key in SPEC_TABLE:
            overrides[name] = value
        elif name in options:
            try:
                options[name] = _coerce(name, description["options"][name], value)
            except InvalidOption as e:
                problems.append(str(e))
        else:
            problems.append(
                f"unknown setting '{name}' for model {model}; recipe options: {', '.join(sorted(options)) or 'none'}; "
                f"specs: {', '.join(sorted(SPEC_TABLE))} (or METHOD.SPEC)"
            )
    if problems:
        raise InvalidOption("; ".join(problems))
    checkpoint = options.get("checkpoint")
    if checkpoint and not os.path.isdir(os.path.expanduser(checkpoint)):
        raise InvalidOption(f"checkpoint directory {checkpoint} does not exist")

    specs = resolve_method_specs(
        target, description["methods"], description["specs"], description["method_specs"], overrides
    )
    autotune = cli.get("autotune") or "auto"
    if autotune not in ("auto", "pin"):
        raise InvalidOption(f"autotune={autotune}: expected auto or pin")
    return BuildConfig(project, model, target, options, specs, description, note, autotune)

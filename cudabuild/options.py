"""A recipe's options as one table, and the one check of what the command line gives them.

Each `Option` says its type (that of its default: int, float, bool or str), its range (`minimum`,
`maximum`) or its `choices`, whether it names a folder that must exist, the targets it applies to
(none named: every target), and what a value means where the value alone does not say
(`meaning={0: "every layer"}`). A recipe declares its table once, for every form it has; a
value given for an option that does not apply to the build's target is refused with the reason,
as is a value of the wrong type, out of range or not among the choices. `check` collects every
problem, one line each, and never stops at the first.

Owns the table's shape, its check and how an option's values are shown. Must not touch torch,
the recipes' registry or the files an option names (beyond "is it a folder"): what a checkpoint
holds is checked by the model that reads it, in the recipe's `resolve`.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from cudabuild.errors import compose

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    choices: tuple = ()
    targets: tuple[str, ...] = ()  # () = every target
    folder: bool = False  # a path to a folder that must exist ("" for none)
    meaning: Mapping[Any, str] = field(default_factory=dict)  # value -> what it means, e.g. {0: "every layer"}
    help: str = ""
    # A folder that may also be named by its Hugging Face Hub id (ORG/NAME[@REV]), which the
    # configuration resolves to its snapshot folder before this table's check (cudabuild.hub).
    hub: bool = False

    def __post_init__(self):
        # A recipe that names its targets by a variable it later rebinds (to a Recipe, say) would
        # otherwise give an option that silently applies nowhere.
        if not (isinstance(self.targets, tuple) and all(isinstance(t, str) for t in self.targets)):
            raise ValueError(f"option {self.name}: targets must be a tuple of target names such as ('cuda',), "
                             f"not {type(self.targets).__name__}")

    @property
    def kind(self) -> type:
        return type(self.default) if type(self.default) in _TYPE_NAMES else str

    def applies_to(self, target: str) -> bool:
        return not self.targets or target in self.targets

    def expected(self) -> str:
        """What a value must be, as a message says it: `an integer >= 0 (default 0: every layer)`."""
        if self.choices:
            text = "one of " + ", ".join(shown(c) if c != "" else "'' (none)" for c in self.choices)
        else:
            text = _TYPE_NAMES[self.kind]
            if self.minimum is not None and self.maximum is not None:
                text += f" from {shown(self.minimum)} to {shown(self.maximum)}"
            elif self.minimum is not None:
                text += f" >= {shown(self.minimum)}"
            elif self.maximum is not None:
                text += f" <= {shown(self.maximum)}"
            if self.folder:
                text = "an existing folder" + (" or a Hugging Face Hub id ORG/NAME[@REVISION]" if self.hub else "") + \
                       " (or '' for none)"
        default = f"default {shown(self.default)}"
        if self.default in self.meaning:
            default += f": {self.meaning[self.default]}"
        return f"{text} ({default})"

    def shown(self, value: Any) -> str:
        """The value as the console shows it, with its meaning where it has one: `0 (every layer)`."""
        text = shown(value)
        return f"{text} ({self.meaning[value]})" if value in self.meaning and not isinstance(value, bool) else text

    def as_data(self) -> dict:
        return {"name": self.name, "default": self.default, "minimum": self.minimum, "maximum": self.maximum,
                "choices": list(self.choices), "targets": list(self.targets), "folder": self.folder,
                "meaning": [[k, v] for k, v in self.meaning.items()], "help": self.help, "hub": self.hub}

    @classmethod
    def from_data(cls, data: Mapping) -> "Option":
        return cls(data["name"], data["default"], data.get("minimum"), data.get("maximum"), tuple(data.get("choices") or ()),
                   tuple(data.get("targets") or ()), bool(data.get("folder")),
                   {k: v for k, v in data.get("meaning") or ()}, data.get("help") or "", bool(data.get("hub")))


Table = tuple[Option, ...]


def table(declared: Union[Mapping[str, Any], Iterable[Option]]) -> Table:
    """A recipe's `options` as a table: Options as declared, or a plain {name: default} mapping
    (each a value of the default's type, any value of it)."""
    if isinstance(declared, Mapping):
        return tuple(Option(name, default) for name, default in declared.items())
    options = tuple(declared)
    names = [o.name for o in options]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"options declared twice: {', '.join(twice)}")
    return options


def defaults(options: Table, target: str) -> dict[str, Any]:
    """{name: default} of the options that apply to `target`, in the table's order."""
    return {o.name: o.default for o in options if o.applies_to(target)}


def shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if abs(value) < 1e15 else str(value)
    return "''" if value == "" else str(value)


def parse(option: Option, raw: Any) -> tuple[Any, Optional[str]]:
    """(the value, None), or (None, why it is not one): `raw` (a command line's string, or a
    value already of the option's type) as the option's type, in its range and choices."""
    kind, text = option.kind, str(raw).strip() if isinstance(raw, str) else raw
    value: Any = text
    if kind is bool:
        if isinstance(raw, bool):
            value = raw
        elif str(text).lower() in _TRUE + _FALSE:
            value = str(text).lower() in _TRUE
        else:
            return None, "not true or false"
    elif kind is int:
        try:
            value = int(text) if not isinstance(text, float) or text.is_integer() else None
        except (TypeError, ValueError):
            value = None
        if value is None or isinstance(raw, bool):
            return None, "not an integer"
    elif kind is float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            return None, "not a number"
        if value != value or value in (float("inf"), float("-inf")):
            return None, "not a finite number"
    else:
        value = str(raw)
    if option.choices and value not in option.choices:
        return None, "not one of the choices"
    if option.minimum is not None and value < option.minimum:
        return None, f"below {shown(option.minimum)}"
    if option.maximum is not None and value > option.maximum:
        return None, f"above {shown(option.maximum)}"
    if option.folder and value and not os.path.isdir(os.path.expanduser(value)):
        path = os.path.expanduser(value)
        if os.path.exists(path):  # a file of the folder given for the folder itself
            return None, f"is a file; expected the {option.name}'s folder (this file's is {os.path.dirname(path) or '.'})"
        return None, "no such folder"
    return value, None


def check(model: str, target: Optional[str], options: Table, given: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """(the options' values for `target`: defaults, then `given`; the problems, one line each).

    `given` holds only names of the table (the caller reports other names). A name whose option
    does not apply to `target` is a problem; so is every value its option cannot take. With no
    target (an unknown one, reported by the caller), only the values are checked."""
    by_name = {o.name: o for o in options}
    values = defaults(options, target) if target else {o.name: o.default for o in options}
    problems = []
    for name, raw in given.items():
        option = by_name[name]
        setting = f"{model} option {name}={shown(raw)}"
        if target and not option.applies_to(target):
            problems.append(compose(f"{setting} applies to target{'s' if len(option.targets) > 1 else ''} "
                                    f"{', '.join(option.targets)} only, not {target}", fix=f"drop it for target={target}"))
            continue
        value, why = parse(option, raw)
        if why is not None:
            # A folder's problem says what the path is; any other value, what the option takes.
            problems.append(compose(setting, why) if option.folder else compose(setting, expected=option.expected()))
            continue
        values[name] = value
    return values, problems


def given_twice(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """A problem line per name given more than once with different values (`layers=1 layers=3`):
    the command line says two things, and taking the last one would build what the user may not
    have meant. The same value twice says one thing, and is no problem."""
    values: dict[str, list[str]] = {}
    for name, value in pairs:
        if value not in values.setdefault(name, []):
            values[name].append(value)
    return [compose(" ".join(f"{name}={v}" for v in given), f"{name} is given {len(given)} values",
                    fix=f"give {name} once") for name, given in values.items() if len(given) > 1]


def closest(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The candidate a mistyped `name` most likely meant (`modle` -> `model`), or None."""
    found = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.7)
    return found[0] if found else None


def names_for(options: Table, target: Optional[str]) -> list[str]:
    return sorted(o.name for o in options if target is None or o.applies_to(target))


def shown_values(options: Table, values: Mapping[str, Any]) -> dict[str, str]:
    """{name: the value as the console shows it} for what a build used, meanings included."""
    by_name = {o.name: o for o in options}
    return {name: by_name[name].shown(value) if name in by_name else shown(value) for name, value in values.items()}


def described(options: Sequence[Option]) -> list[dict]:
    return [o.as_data() for o in options]

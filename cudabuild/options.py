"""A recipe's options as one table, the one check of what the command line gives them, and the
typed object a build's options become (`Options`).

Owns the table's shape, its check, the typed object it makes and how an option's values are shown.
Must not touch torch, the recipes' registry or the files an option names (beyond "is it a folder"):
what a checkpoint holds is checked by the model that reads it, in the recipe's `resolve`.

Each `Option` says its type (that of its default: int, float, bool or str), its range (`minimum`,
`maximum`) or its `choices`, whether it names a folder that must exist, the targets it applies to
(none named: every target), and what a value means where the value alone does not say
(`meaning={0: "every layer"}`); and what the build does with it: whether it decides the quantize
stage's weights (`quantize`), changes the weights' values and nothing else (`values_only`), names
the checkpoint the weights are read from (`checkpoint`), or is decided by another option when that
one is given (`decided_by`). A recipe declares its table once, for every form it has; a value given
for an option that does not apply to the build's target is refused with the reason, as is a value
of the wrong type, out of range or not among the choices. `check` collects every problem, one line
each, and never stops at the first; what it accepts is an `Options`: an attribute per row
(`options.layers`), which is what the models read.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

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
    # What the build does with it (cudabuild.registry describes them, cudabuild.pipeline keys them):
    # it decides the prepared weights, so the quantize stage's key holds it (a folder by its content);
    quantize: bool = False
    # it changes the weights' values and nothing else (a seed): the trace is not keyed on it, and
    # `cudabuild explain` forecasts that changing it keeps the lowered and compiled code;
    values_only: bool = False
    # it names the Hugging Face checkpoint the model's weights are read from: export keys its
    # tensors, the trace their layout (a folder option; one a table at most);
    checkpoint: bool = False
    # it is decided by the option named here when that one is given (a prequantized bundle decides
    # its own quantization): it must then stay at its default.
    decided_by: str = ""

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
                "meaning": [[k, v] for k, v in self.meaning.items()], "help": self.help, "hub": self.hub,
                "quantize": self.quantize, "values_only": self.values_only, "checkpoint": self.checkpoint,
                "decided_by": self.decided_by}

    @classmethod
    def from_data(cls, data: Mapping) -> "Option":
        return cls(data["name"], data["default"], data.get("minimum"), data.get("maximum"), tuple(data.get("choices") or ()),
                   tuple(data.get("targets") or ()), bool(data.get("folder")),
                   {k: v for k, v in data.get("meaning") or ()}, data.get("help") or "", bool(data.get("hub")),
                   bool(data.get("quantize")), bool(data.get("values_only")), bool(data.get("checkpoint")),
                   data.get("decided_by") or "")


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
    problems = [f"option {o.name}: its name is one of the options object's own ({o.name})"
                for o in options if hasattr(Options, o.name) or o.name.startswith("_")]
    problems += [f"option {o.name}: decided_by={o.decided_by} names no option of the table"
                 for o in options if o.decided_by and o.decided_by not in names]
    problems += [f"option {o.name}: checkpoint=True needs folder=True" for o in options if o.checkpoint and not o.folder]
    if sum(o.checkpoint for o in options) > 1:
        problems.append(f"options {', '.join(o.name for o in options if o.checkpoint)}: one checkpoint option at most")
    if problems:
        raise ValueError("; ".join(problems))
    return options


def defaults(options: Table, target: str) -> dict[str, Any]:
    """{name: default} of the options that apply to `target`, in the table's order."""
    return {o.name: o.default for o in options if o.applies_to(target)}


class Options(Mapping):
    """One build's options, typed: an attribute per row of the recipe's table (`options.layers`),
    each a value of the row's type, in its range and choices, as the option parser (`check`) made
    it; then what the recipe's `resolve` filled in. Immutable; `replace` makes another.

    A row that does not apply to the build's target reads None (`options.qlinear` on the CPU); a
    name that is no row is an AttributeError. As a mapping it holds the options that apply, in the
    table's order: what the keys, the manifest and the messages hold (`dict(options)`).
    """

    __slots__ = ("_rows", "_values")

    def __init__(self, rows: Iterable[Option], values: Mapping[str, Any]):
        rows = tuple(rows)
        named = {o.name for o in rows}
        strangers = [name for name in values if name not in named]
        if strangers:
            raise KeyError(f"not options of this table: {', '.join(strangers)} (its options: {', '.join(sorted(named))})")
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_values", {o.name: values[o.name] for o in rows if o.name in values})

    @property
    def rows(self) -> Table:
        return self._rows

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        if any(o.name == name for o in self._rows):
            return None  # a row that does not apply to this build's target
        raise AttributeError(f"'{name}' is not an option of this recipe (its options: "
                             f"{', '.join(o.name for o in self._rows)})")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"options are not changed in place; options.replace({name}=...) makes new ones")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Options({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def __reduce__(self):
        return Options, (self._rows, self._values)

    def replace(self, **changes: Any) -> "Options":
        """These options with `changes` (names of options that apply to the build) made."""
        strangers = [name for name in changes if name not in self._values]
        if strangers:
            raise KeyError(f"not options of this build: {', '.join(strangers)} (its options: {', '.join(self._values)})")
        return Options(self._rows, {**self._values, **changes})

    def decided(self) -> dict[str, tuple[list[str], list[str]]]:
        """For each option given here that decides others by itself (the rows whose `decided_by`
        names it): (the names it decides, `name=value` of each of them not at its default)."""
        found: dict[str, tuple[list[str], list[str]]] = {}
        for decider in self._rows:
            decides = [o for o in self._rows if o.decided_by == decider.name and o.name in self._values]
            if decides and self._values.get(decider.name):
                found[decider.name] = ([o.name for o in decides],
                                       [f"{o.name}={self._values[o.name]}" for o in decides if self._values[o.name] != o.default])
        return found


def typed_defaults(options: Table, target: str) -> Options:
    """The options of `target` at their defaults, typed (what `check` gives where nothing is set)."""
    return Options(options, defaults(options, target))


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


def check(model: str, target: Optional[str], options: Table, given: Mapping[str, Any]) -> tuple[Options, list[str]]:
    """(the options for `target`, typed: defaults, then `given`; the problems, one line each).

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
    return Options(options, values), problems


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

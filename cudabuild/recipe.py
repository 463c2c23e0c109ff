"""What a recipe declares: a model factory, its methods and their compile specs, as plain data.

A recipe file (`recipes/<name>.py`) defines one module-level `RECIPE = Recipe(...)`. It parses no
command line and does no I/O at import time; everything that needs torch happens inside the
callables it hands over, which the export stage calls. This module must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

# Spec values are per target: {"cpu": {...}, "cuda": {...}}; "all" applies to every target.
TargetSpecs = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True)
class Method:
    """One exported entry point of the model.

    `inputs(model)` returns the example inputs (a tuple of tensors); `dynamic_shapes(model)`, when
    given, returns what torch.export takes for them. Both receive the built model so they can read
    its configuration (max_seq_len and the like). `specs` overrides the recipe's specs for this
    method only, per target.
    """

    name: str
    inputs: Callable[[Any], tuple]
    dynamic_shapes: Optional[Callable[[Any], Any]] = None
    specs: TargetSpecs = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    """A model and how to lower it.

    `build(options)` returns the eager `torch.nn.Module`; `options` holds the recipe's defaults
    merged with command-line values (`size=35b-a3b layers=4 checkpoint=DIR`), coerced to the type
    of each default (a default of None takes strings), then passed through `resolve` when given.
    `constant_methods(model)` returns the metadata methods written into the .pte (ints, floats,
    strings, lists of them).
    """

    build: Callable[[Mapping[str, Any]], Any]
    methods: tuple[Method, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    # The values an option accepts, e.g. {"size": ("tiny", "35b-a3b")}: checked with the command line.
    choices: Mapping[str, tuple] = field(default_factory=dict)
    # `resolve(options)` fills in options whose value follows from others (a length read from the
    # checkpoint's config.json) and refuses what cannot be built, before any stage runs; what it
    # returns is what the keys and the manifest hold. It may read the checkpoint's config.json only.
    resolve: Optional[Callable[[Mapping[str, Any]], Mapping[str, Any]]] = None
    specs: TargetSpecs = field(default_factory=dict)
    constant_methods: Optional[Callable[[Any], Mapping[str, Any]]] = None
    # Per-dtype verify tolerance overrides, e.g. {"float32": 1e-4}.
    tolerances: Mapping[str, float] = field(default_factory=dict)

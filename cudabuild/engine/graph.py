"""The build graph: which stages a build has, what each consumes, and what decides its key.

    probe ─┬─> export[m] ─> edge[m] ─> compile[m] ─┬─> package ──> (outputs in build/<model>/<target>/)
           │                                      └─> verify[m]
           └──────────────(toolchain)─────────────┘

A stage's key is the digest of its *inputs*: a JSON dict of its own parameters and the digests of
the upstream results it consumes. An upstream digest is semantic where it can be (export and edge
report a canonical graph hash, not the bytes of a serialized file), so an edit that leaves the
graph alone stops the rebuild there: early cutoff. The inputs dict is kept in each stamp, which is
how `explain` names what changed. Bump a stage's version when its implementation changes what it
produces. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from cudabuild.config import BuildConfig
from cudabuild.specs import specs_for_stage
from cudabuild.backend.tuning import pinned_digest

STAGE_VERSIONS = {"probe": 1, "export": 2, "edge": 3, "compile": 1, "package": 3, "verify": 1}
KINDS = tuple(STAGE_VERSIONS)


@dataclass(frozen=True)
class Stage:
    kind: str
    method: Optional[str] = None

    @property
    def id(self) -> str:
        return f"{self.kind}.{self.method}" if self.method else self.kind


def plan(config: BuildConfig) -> list[Stage]:
    """Every stage of the build, in an order that respects dependencies."""
    methods = config.methods
    stages = [Stage("probe")]
    for kind in ("export", "edge", "compile"):
        stages += [Stage(kind, m) for m in methods]
    stages.append(Stage("package"))
    stages += [Stage("verify", m) for m in methods]
    return stages


def dependencies(stage: Stage, config: BuildConfig) -> list[Stage]:
    m = stage.method
    if stage.kind == "probe":
        return []
    if stage.kind == "export":
        return [Stage("probe")]
    if stage.kind == "edge":
        return [Stage("probe"), Stage("export", m)]
    if stage.kind == "compile":
        return [Stage("probe"), Stage("edge", m)]
    if stage.kind == "package":
        return [Stage("probe")] + [Stage(k, x) for x in config.methods for k in ("export", "compile")]
    if stage.kind == "verify":
        return [Stage("probe"), Stage("export", m), Stage("compile", m), Stage("package")]
    raise ValueError(stage.kind)


# What a stage needs from the rest of the system to compute its inputs, without torch.
StampReader = Callable[[Stage], Optional[dict]]


def _digest_of(read: StampReader, stage: Stage) -> Optional[str]:
    stamp = read(stage)
    return stamp["digest"] if stamp else None


def _toolchain(read: StampReader, *fields: str) -> dict:
    stamp = read(Stage("probe"))
    value = (stamp or {}).get("value") or {}
    return {f: value.get(f) for f in fields} if fields else value


def stage_inputs(stage: Stage, config: BuildConfig, read: StampReader, cheap_fingerprint: Callable[[], dict],
                 checkpoint_digest: Callable[[], Optional[dict]]) -> dict:
    """The JSON inputs whose digest is the stage's action key."""
    m = stage.method
    base = {"stage": stage.kind, "version": STAGE_VERSIONS[stage.kind], "target": config.target}
    if m:
        base["method"] = m
    if stage.kind == "probe":
        return {**base, "fingerprint": cheap_fingerprint()}
    if stage.kind == "export":
        return {
            **base,
            "model": config.model,
            "sources": dict(config.description["sources"]),
            "options": dict(config.options),
            "checkpoint": checkpoint_digest(),
            "toolchain": _toolchain(read, "torch"),
        }
    if stage.kind == "edge":
        return {
            **base,
            "graph": _digest_of(read, Stage("export", m)),
            "specs": specs_for_stage(config.specs[m], "edge"),
            "toolchain": _toolchain(read, "torch", "executorch", "triton"),
        }
    if stage.kind == "compile":
        return {
            **base,
            "graph": _digest_of(read, Stage("edge", m)),
            "specs": specs_for_stage(config.specs[m], "compile"),
            "toolchain": _toolchain(read),
            # Pinned tuning decisions dictate the kernels: a different pin is a different compile.
            "autotune_pin": pinned_digest(config.project, config.model, config.target, m),
        }
    if stage.kind == "package":
        return {
            **base,
            "methods": {
                x: {
                    "graph": _digest_of(read, Stage("export", x)),
                    "compiled": _digest_of(read, Stage("compile", x)),
                    "specs": dict(config.specs[x]),
                }
                for x in config.methods
            },
            "toolchain": _toolchain(read, "torch", "executorch"),
        }
    if stage.kind == "verify":
        return {
            **base,
            "graph": _digest_of(read, Stage("export", m)),
            "compiled": _digest_of(read, Stage("compile", m)),
            "tolerances": dict(config.description.get("tolerances", {})),
            "toolchain": _toolchain(read, "torch"),
        }
    raise ValueError(stage.kind)


# The build outputs a stage places in build/<model>/<target>/ (everything else stays in the store).
def final_outputs(stage: Stage) -> bool:
    return stage.kind == "package"

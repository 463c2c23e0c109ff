"""A stage's stamp: build/<model>/<target>/.stamps/<stage id>.json, what the last run or restore of
that stage in this build directory recorded.

The one reader and the one writer of stamps (`Stamps`: a build directory's). A stamp holds the
stage's action key and the inputs that key was computed from (how `explain` names what changed),
the stage's semantic digest, its outputs' blob hashes (which of them were placed in build/:
`finals`), its value, and how and when it was brought up to date. Everything else (the runner, a
stage's I/O, explain, the manifest, the cache tools, autotune pinning) reads stamps through these
classes. A stamp that cannot be read (damaged, written by an incompatible cudabuild) is treated as
absent: its stage is decided again from the store.

Owns the stamp's format and its file. Must not touch: what a stamp should say (the runner decides
that), the store.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from cudabuild.errors import CudabuildError
from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.graph import Result, Stage


@dataclass(frozen=True)
class Stamp:
    key: str
    inputs: dict
    digest: str
    outputs: dict  # output name -> sha256 of its blob
    finals: list = field(default_factory=list)  # the outputs placed in build/
    value: Optional[dict] = None
    status: str = "ran"  # ran | restored | remote
    seconds: float = 0.0  # what bringing it up to date took here
    run: Optional[str] = None  # the id of the build process that wrote it
    reason: Optional[str] = None  # why it ran (None for a restore)
    saved_seconds: Optional[float] = None  # a restore: what the run it replaced took
    peak_rss: Optional[int] = None  # a run: the process's resident bytes at the stage's peak (sampled)
    written_bytes: Optional[int] = None  # a run: what its process wrote to storage (/proc/self/io)
    peak_private: Optional[int] = None  # a run: the private part of its resident peak (memory.PeakSampler)
    # A run on a cluster's worker (cudabuild.engine.cluster): where it ran (address, name, host, pid,
    # gpu) and, under `lost`, the workers that died running it before.
    worker: Optional[dict] = None

    @property
    def result(self) -> Result:
        return Result(self.digest, self.value, self.outputs)

    @property
    def cost_seconds(self) -> float:
        """What running the stage costs: this run's time, or, for a restore, the time it saved."""
        return self.saved_seconds if self.saved_seconds is not None else self.seconds

    def replace(self, **changes) -> "Stamp":
        return dataclasses.replace(self, **changes)

    # -- the one reader and writer ------------------------------------------------------------

    @classmethod
    def from_json(cls, data) -> Optional["Stamp"]:
        if not isinstance(data, dict):
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            stamp = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:  # a required field is missing
            return None
        well_formed = (isinstance(stamp.key, str) and isinstance(stamp.inputs, dict) and isinstance(stamp.outputs, dict)
                       and all(name in stamp.outputs for name in stamp.finals))
        return stamp if well_formed else None

    @classmethod
    def load(cls, path: Path) -> Optional["Stamp"]:
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError):  # absent, being replaced right now, or damaged
            return None

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True))


def stamps_dir(build_dir: Path) -> Path:
    return build_dir / ".stamps"


@dataclass(frozen=True)
class Stamps:
    """The stamps of one build directory (build/<model>/<target>/, which `build` names as
    "model/target" in messages): read by whoever decides a stage or reads its upstream outputs,
    written by whoever brings a stage up to date."""

    build_dir: Path
    build: str

    @classmethod
    def of(cls, config) -> "Stamps":
        """The stamps of a build (a cudabuild.engine.graph.Build)."""
        return cls(config.build_dir, f"{config.model}/{config.target}")

    def path(self, stage: Stage) -> Path:
        return stamps_dir(self.build_dir) / f"{stage.id}.json"

    def read(self, stage: Stage) -> Optional[Stamp]:
        return Stamp.load(self.path(stage))

    def result(self, stage: Stage) -> Optional[Result]:
        stamp = self.read(stage)
        return stamp.result if stamp else None

    def require(self, stage: Stage) -> Stamp:
        stamp = self.read(stage)
        if stamp is None:
            raise CudabuildError(f"stage {stage.id} has not been built yet for {self.build}")
        return stamp

    def write(self, stage: Stage, stamp: Stamp) -> None:
        stamp.save(self.path(stage))


def all_stamps(project: Path) -> Iterator[tuple[str, Stamp]]:
    """("model/target/stage", stamp) for every readable stamp under project/build/."""
    for path in sorted(Path(project).glob("build/*/*/.stamps/*.json")):
        stamp = Stamp.load(path)
        if stamp is not None:
            yield f"{path.parent.parent.parent.name}/{path.parent.parent.name}/{path.stem}", stamp

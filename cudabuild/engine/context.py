"""What a stage function is handed (`StageContext`) and what it returns (`StageResult`).

Every stage module (cudabuild/backend/stages/) has `run(ctx) -> StageResult`. The context names
the build, the stage, its key and inputs, a fresh work directory, and reads upstream outputs
through the stage's I/O (cudabuild.engine.stage_io: verified, and made again by their producer
when a blob turns out bad). It holds no runner: a stage does not load the runner to describe
itself, nor reach what decides and stores it. Owns those two shapes only. Must not touch: how a
stage is decided, run or stored (runner.py, executors.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from cudabuild.engine.console import terminal
from cudabuild.engine.graph import Build, Stage

if TYPE_CHECKING:  # a stage module that imports StageResult loads neither the stores nor the runner
    from cudabuild.engine.stage_io import StageIO


@dataclass
class StageResult:
    """What a stage function returns: files it wrote (name -> path), its semantic digest and value.

    `known` gives the sha256 of files the stage hashed already (so they are not read again);
    `stored` names outputs that are blobs already in the store (name -> sha256), handed on from
    upstream unchanged and so neither written nor hashed: a stage need not copy gigabytes of
    weights it did not change. `regions` says where an output repeats bytes the store may hold.
    """

    files: dict[str, Path]
    digest: Optional[str] = None
    value: Optional[dict] = None
    known: dict[str, str] = field(default_factory=dict)
    stored: dict[str, str] = field(default_factory=dict)
    # name -> [(offset, length)]: where an output may repeat bytes the store holds (a tensor's data,
    # a constant in a weights blob), so it can be kept as ranges of them (cudabuild.engine.spans).
    regions: dict[str, list] = field(default_factory=dict)


@dataclass
class StageContext:
    """One run of one stage: its upstream outputs, what it keeps and the cache's documents are
    read and written through `io` (a StageIO); `workers`: how many stages this build runs at once
    (cudabuild.engine.workers)."""

    config: Build
    stage: Stage
    inputs: dict
    key: str
    workdir: Path
    io: StageIO
    log: Callable[[str], None] = terminal.note
    workers: int = 1

    def upstream(self, kind: str, method: Optional[str] = None):
        """The stamp of an upstream stage: its outputs by name, digest and value."""
        return self.io.stamp(Stage(kind, method))

    def blob(self, kind: str, method: Optional[str], name: str) -> bytes:
        """An upstream output's bytes, verified; rebuilds the producer if the blob is bad."""
        return self.io.read(Stage(kind, method), name)

    def blob_path(self, kind: str, method: Optional[str], name: str) -> Path:
        """The store's own file of an upstream output, verified: to read or memory-map, never to
        write. For outputs of gigabytes, which `blob` would copy into memory."""
        return self.io.path(Stage(kind, method), name)

    def blob_file(self, kind: str, method: Optional[str], name: str):
        """A context manager: a file of an upstream output's bytes for the block (ObjectStore.blob_file):
        for a reader that needs a path once, without leaving a copy of a blob kept as spans."""
        return self.io.file(Stage(kind, method), name)

    def reader(self, kind: str, method: Optional[str]) -> Callable[[str], Path]:
        """`blob_path` of one upstream stage's outputs by name, with `.sha(name)` their sha256 and
        `.mapped(name)` what ObjectStore.mapped_parts says of them."""
        read = functools.partial(self.blob_path, kind, method)
        read.sha = lambda name: self.upstream(kind, method).outputs[name]
        # An output kept as ranges of other blobs: its (manifest, files), to map rather than materialize.
        read.mapped = lambda name: self.io.mapped(Stage(kind, method), name)
        return read

    def fetch(self, kind: str, method: Optional[str], name: str, dest: Path) -> Path:
        return self.io.fetch(Stage(kind, method), name, dest)

    def keep(self, path: Path, sha: Optional[str] = None, regions: Optional[list] = None) -> str:
        """Store a file this stage wrote, now, before the stage returns: moved into the cache (or
        kept as ranges of blobs stored already) and gone from the work folder. Its sha256, to name
        in StageResult.stored. For a stage whose outputs together are many GB (a program's weight
        files): they are then never all on the disk beside the cache at once."""
        return self.io.keep(path, sha, regions)

    def holds(self, sha: str, length: int) -> bool:
        """Whether the store holds these bytes already (their sha256 and length), so that a file
        this stage writes may leave them out as a hole (ObjectStore.put_file's digested regions)."""
        return self.io.objects.holds(sha, length)

    # -- what a stage reads beside its upstream outputs: never the store itself --------------------

    def checkpoint_digest(self) -> Optional[dict]:
        """The content digest of the build's checkpoint (file by file, part by part), or None
        without one: what decides its weights' values, for a stage whose key holds less of it."""
        return self.config.pipeline.checkpoint_digest(self.config, self.io.objects.hasher)

    @property
    def recipe(self):
        """The recipe's form for this build's target (recipes/<model>.py's RECIPE.for_target),
        as the build's configuration loads it (cudabuild.config.BuildConfig.recipe; imports torch)."""
        return self.config.recipe

    def handed_on(self, sha: str) -> Path:
        """`blob_path` of an upstream output named by its sha256 instead of its name (a weight
        file of a program loaded from upstream, which a stage hands on unchanged): verified, its
        producer rebuilt when the blob is bad."""
        return self.io.path_of_sha(sha)

    @property
    def cache_root(self) -> Path:
        """The cache's folder: where this machine's caches of a stage's tools (inductor's kernels,
        C++ objects) and the locks they share live. Not the store's entries: those are read above."""
        return self.io.objects.root

    @property
    def shared_tier(self):
        """The shared tier ($CUDABUILD_REMOTE, a cudabuild.engine.tiers Tier), or None: for a stage's
        tools that share their own caches there (compiled C++ objects)."""
        return self.io.objects.remote

    def document(self, name: str) -> Optional[dict]:
        """A small JSON document of the cache (`tune:<key>`: a compile's tuning decisions), or None."""
        return self.io.actions.get_json(name)

    def keep_document(self, name: str, value: dict) -> None:
        """Keep a small JSON document in the cache (and the shared tier, for the kinds it shares)."""
        self.io.actions.put_json(name, value)

"""A running stage's I/O: the upstream outputs it reads, the files it keeps, the documents it asks
for, and what is done about an upstream blob that turns out bad.

A `StageIO` is data the runner hands an executor in the Job (cudabuild.engine.executors): the
stage's upstream stages and the stamps that name their outputs, the object store and the action
cache those outputs and documents are in, and `rewind`, what to do about a bad blob. It is built
the same way wherever the stage runs: by the runner that decided it, or, for a stage handed to
another process, there (cudabuild.warm_stage, cudabuild.cluster_worker), from the stamps and the
cache that process has. The stage reads it through its StageContext, never the runner.

Every upstream output is served verified (the object store re-hashes it, once per change of its
file). One that is corrupt or gone is never served: its producer is brought up to date again and
the read tried once more (`rewind`, the runner's, which runs the producer through the build's
executor: what Bazel calls rewinding). Where the stage runs in a process that cannot run its
producer, `rewind` is None and the read raises LostInput instead: the runner that handed the
stage over rewinds the producer and runs the stage again. An output a stage hands on unchanged
(StageResult.stored) that is gone from both tiers is treated the same way (`handed_on`).

Owns reading upstream outputs, keeping a running stage's files, and what a bad blob sets off. Must
not touch: the decision, running a stage, storing its result or its stamp (runner.py, executors.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Optional

from cudabuild.engine.action_cache import ActionCache
from cudabuild.engine.console import terminal
from cudabuild.engine.graph import Stage
from cudabuild.engine.object_store import ObjectStore
from cudabuild.engine.stamp import Stamp, Stamps
from cudabuild.errors import CorruptBlob, CudabuildError, MissingBlob


class LostInput(CudabuildError):
    """An upstream output of `producer` (kind, method) was corrupt or gone where a stage ran, in a
    process that cannot run the producer (a warm process, a cluster's worker): the runner that
    handed the stage over rewinds the producer and runs the stage again (Bazel's
    LostInputsExecException). Its message is the blob's own error."""

    def __init__(self, kind: str, method: Optional[str], message: str):
        self.kind, self.method = kind, method
        super().__init__(message)

    @property
    def producer(self) -> Stage:
        return Stage(self.kind, self.method)

    def __reduce__(self):  # pickled with its arguments (a warm process's answer)
        return type(self), (self.kind, self.method, str(self))


@dataclasses.dataclass(frozen=True)
class StageIO:
    """The I/O of one run of `stage`: `upstream`, the stages it depends on, whose outputs `stamps`
    name and `objects` holds; `actions`, the cache its documents are kept in; `rewind(producer)`,
    what to do about a bad blob (None: raise LostInput)."""

    stage: Stage
    upstream: tuple[Stage, ...]
    stamps: Stamps
    objects: ObjectStore
    actions: ActionCache
    rewind: Optional[Callable[[Stage], None]] = None

    def stamp(self, stage: Stage) -> Stamp:
        """An upstream stage's stamp: its outputs by name, digest and value."""
        return self.stamps.require(stage)

    def upstream_stamps(self) -> dict:
        """{stage id: stamp as JSON} of the upstream stages built so far: what a process elsewhere
        keys the stage on (cudabuild.cluster_worker)."""
        return {d.id: dataclasses.asdict(stamp) for d in self.upstream if (stamp := self.stamps.read(d)) is not None}

    # -- upstream outputs, verified --------------------------------------------------------------

    def read(self, stage: Stage, name: str) -> bytes:
        return self._serve(stage, name, self.objects.read_bytes)

    def path(self, stage: Stage, name: str) -> Path:
        """The store's own file of the output, verified: to read or map, never to write."""
        return self._serve(stage, name, self.objects.verified_path)

    @contextlib.contextmanager
    def file(self, stage: Stage, name: str):
        """A private file of the output for the block (ObjectStore.blob_file)."""
        with contextlib.ExitStack() as stack:
            yield self._serve(stage, name, lambda sha: stack.enter_context(self.objects.blob_file(sha, for_name=name)))

    def mapped(self, stage: Stage, name: str):
        """ObjectStore.mapped_parts of the output: for one kept as spans, what to map."""
        return self._serve(stage, name, self.objects.mapped_parts)

    def fetch(self, stage: Stage, name: str, dest: Path) -> Path:
        return self._serve(stage, name, lambda sha: self.objects.fetch(sha, dest))

    def path_of_sha(self, sha: str) -> Path:
        """`path` of the upstream output with this sha256 (a file handed on unchanged, named by its hash)."""
        producer = self._producer_of(sha)
        if producer is None:
            raise CudabuildError(f"stage {self.stage.id} reads blob {sha[:12]}, which none of the stages it depends on made")
        return self.path(*producer)

    def _serve(self, stage: Stage, name: str, take: Callable[[str], object]):
        """`take(sha)` of an upstream output; when the blob is corrupt or gone, what `rewind` says
        is done about it, and the new blob taken instead."""
        try:
            return take(self._sha_of(stage, name))
        except (CorruptBlob, MissingBlob) as e:
            terminal.warn(str(e))
            self._lost(stage, e)
            return take(self._sha_of(stage, name))

    def _lost(self, producer: Stage, error: CudabuildError) -> None:
        """What is done about a bad blob of `producer`: it is brought up to date again, or, where
        this process cannot, the runner that handed the stage over is told (LostInput)."""
        if self.rewind is None:
            raise LostInput(producer.kind, producer.method, str(error)) from error
        self.rewind(producer)

    def _sha_of(self, stage: Stage, name: str) -> str:
        stamp = self.stamp(stage)
        try:
            return stamp.outputs[name]
        except KeyError:
            raise CudabuildError(f"stage {stage.id} has no output named {name}") from None

    def _producer_of(self, sha: str) -> Optional[tuple[Stage, str]]:
        """(the upstream stage that recorded an output with this sha256, its name), or None."""
        for upstream in self.upstream:
            stamp = self.stamps.read(upstream)
            name = next((n for n, s in sorted(stamp.outputs.items()) if s == sha), None) if stamp else None
            if name is not None:
                return upstream, name
        return None

    # -- what the stage keeps ------------------------------------------------------------------

    def keep(self, path: Path, sha: Optional[str] = None, regions: Optional[list] = None) -> str:
        """A running stage's file stored now; the work folder no longer holds it."""
        sha = self.objects.put_file(path, sha, regions, take=True)
        Path(path).unlink(missing_ok=True)  # kept as ranges of other blobs: not taken
        return sha

    def handed_on(self, stored: dict[str, str]) -> dict[str, str]:
        """Outputs handed on from upstream unchanged (StageResult.stored): blobs this cache holds,
        or the shared tier does (on a cluster's worker whose upstream stage ran on another worker,
        the blob is there only; ActionCache.push then leaves it where it is). One that is in
        neither (found corrupt and dropped since its producer stored it: a stage that hands a
        compiled .so on never reads it) is a bad blob as one the stage reads is: its producer is
        rewound (or LostInput raised); the stage may hand on what that makes only when it is the
        same bytes, since what else the stage made was made with the old ones."""
        remote = self.objects.remote
        in_remote = lambda shas: remote is not None and remote.has_blobs(shas)  # noqa: E731
        missing = sorted(name for name, sha in stored.items() if not self.objects.has_blob(sha))
        if not missing or in_remote([stored[name] for name in missing]):  # one question for them all
            return dict(stored)
        where = f"the cache at {self.objects.root}" + (f" or the shared tier {remote.where}" if remote is not None else "")
        for name in missing:
            sha = stored[name]
            if in_remote([sha]):
                continue
            producer = self._producer_of(sha)
            if producer is None:
                raise CudabuildError(f"stage {self.stage.id} handed on {name}, which is no longer in {where}")
            self._lost(producer[0], MissingBlob(f"blob {sha[:12]} is not in {where}"))
            again = self._sha_of(*producer)
            if again != sha or not self.objects.has_blob(sha):
                raise CudabuildError(f"stage {self.stage.id} handed on {name} of {producer[0].id}, which was no longer in "
                                     f"{where}; made again, it is other bytes ({again[:12]}, not {sha[:12]}): build "
                                     "again, and the stage runs on the new one")
        return dict(stored)

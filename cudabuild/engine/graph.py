"""The build graph as a table: one `StageKind` row per kind of stage, and what the engine derives
from the rows (the plan, each stage's dependencies, its key inputs, which upstream an input names).

A stage's key is the digest of its *inputs*: a JSON dict of its own parameters and the digests of
the upstream results it consumes. An upstream digest is semantic where it can be (export and edge
report a canonical graph hash, not the bytes of a serialized file), so an edit that leaves the
graph alone stops the rebuild there: early cutoff. A result may also carry named digests of a
part of it (*facets*, in its value's `facets` dict): export's `code` is its graph hash with the
weights' values left out, and a stage keyed on `export[m]:code` is untouched by new weights (a
result that lacks the facet it is read for is read whole). The
inputs dict is kept in each stamp, which is how `explain` names what changed. Bump a row's version
when its stage's implementation changes what it produces.

The rows themselves (which stages the CUDA lowering has) are in cudabuild.pipeline; adding a stage
kind is one row there and one module under cudabuild.backend.stages. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional, Protocol


class Build(Protocol):
    """What the engine reads of one build: a plain description its caller fills in
    (cudabuild.config.BuildConfig is one), so the engine imports nothing above itself to get it.
    The rows' own functions (`params`, `runs_alone`, `device`) get the caller's object and may
    read more of it than this."""

    project: Path  # the project's root: recipes/, build/
    model: str
    target: str
    methods: list[str]
    options: Mapping[str, Any]  # the recipe's options, resolved
    specs: Mapping[str, Mapping[str, str]]  # method -> {spec: value}
    build_dir: Path  # build/<model>/<target>/: stamps, final outputs, logs, trace
    checkpoint: Optional[Path]  # a checkpoint folder that enters export's key, or None
    pipeline: Pipeline  # the table of stage kinds that builds it


@dataclass(frozen=True)
class Stage:
    kind: str
    method: Optional[str] = None

    @property
    def id(self) -> str:
        return f"{self.kind}.{self.method}" if self.method else self.kind

    @classmethod
    def parse(cls, stage_id: str) -> "Stage":
        """The stage an id names ("compile.decode", "package")."""
        kind, _, method = stage_id.partition(".")
        return cls(kind, method or None)


class Pending(str):
    """A result known only after `stage` has run (a str so it fits in inputs; equal to no real value).

    `cudabuild explain` keys stages on what it can predict; where an upstream will run, the
    upstream's digest is Pending and the stage's verdict waits on it instead of guessing.
    """

    stage: str

    def __new__(cls, stage: str) -> "Pending":
        self = super().__new__(cls, f"<result of {stage}>")
        self.stage = stage
        return self


def pending_in(value: Any) -> set[str]:
    """The stages whose Pending results appear anywhere in a JSON value."""
    if isinstance(value, Pending):
        return {value.stage}
    if isinstance(value, dict):
        return set().union(*(pending_in(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(pending_in(v) for v in value)) if value else set()
    return set()


class Result(NamedTuple):
    """What a dependent reads of an upstream stage: its semantic digest, its value (probe's
    toolchain report, verify's numbers) and its output blobs by name."""

    digest: Optional[str]
    value: Optional[dict] = None
    outputs: Optional[dict] = None


# How the engine hands upstream results to a key computation: None when the upstream has none yet.
ResultReader = Callable[[Stage], Optional[Result]]


@dataclass(frozen=True)
class KeyContext:
    """What a row's `params` may read to compute a stage's own key inputs, all without torch."""

    config: Build
    method: Optional[str]
    read: ResultReader
    fingerprint: Callable[[], dict]
    # (folder=None, layout=False) -> the folder's digest, file by file (part by part where the
    # pipeline can split a file; with `layout`, each part by what it is, not what it holds); with no
    # folder, the build's checkpoint's (None when it has none).
    checkpoint_digest: Callable[..., Optional[dict]]


@dataclass(frozen=True)
class StageKind:
    """One row of the build graph.

    `consumes` names upstream stages: "probe" (a stage run once per build), "export[m]" (the same
    method's), "compile[*]" (every method's). `results` maps an input field to the consumed stage
    whose digest it holds, in the same notation: "edge[m]" and "package" fill inputs[field],
    "compile[*]" fills inputs["methods"][m][field] for every method; "export[m]:code" holds the
    upstream result's facet `code` instead of its digest. `params` adds the stage's other key inputs.
    """

    kind: str
    version: int
    per_method: bool
    module: str  # where `run(ctx) -> StageResult` lives
    consumes: tuple[str, ...] = ()
    results: Mapping[str, str] = field(default_factory=dict)
    params: Callable[[KeyContext], dict] = lambda ctx: {}
    final_outputs: bool = False  # its files are the build's outputs, placed in build/<model>/<target>/
    # explain tells the node-level difference of a graph where it is consumed first (edge reads the
    # exported graph, compile the edge graph); later consumers just say it changed.
    explains_graph: bool = False
    # What explain predicts a stage's value will be before it runs (probe's: the toolchain).
    predict_value: Optional[Callable[[Optional[dict], dict], dict]] = None
    # (config, method) -> why the stage must have the machine to itself (it times kernels on the
    # CPU), or None; and the accelerator it uses, which one stage at a time may use, or None
    # (see cudabuild.engine.workers).
    runs_alone: Optional[Callable[[Build, Optional[str]], Optional[str]]] = None
    device: Optional[Callable[[Build, Optional[str]], Optional[str]]] = None
    # Whether the stage's peak memory scales with its upstream outputs' bytes. Export's does not:
    # it scales with the model it builds, which only a checkpoint's size or its last run tells.
    memory_from_upstream: bool = True
    # The stage's peak resident memory as a multiple of its inputs' weights, which sizes a first
    # run's reservation of the machine's memory (cudabuild.engine.admission); None: INPUT_FACTOR.
    memory_factor: Optional[float] = None
    # (config, method) -> the stage's peak device bytes as a multiple of its inputs' weights, which
    # sizes its first run's reservation of the device (cudabuild.engine.workers) before a run is measured.
    device_factor: Optional[Callable[[Build, Optional[str]], float]] = None
    # config -> whether the build has this stage at all (a recipe that quantizes has a quantize
    # stage; others do not). A stage absent from a build is left out of its plan, and consumers
    # neither wait for it nor key on it: their keys are what they were without the row.
    applies: Optional[Callable[[Build], bool]] = None
    # config -> the input paths (("options", "seed"), ...) whose change gives the stage's result
    # other weights' values and nothing else: its facets stay. What explain predicts with
    # (cudabuild.engine.explain); a stage that runs computes its facets, predicted or not.
    values_only: Optional[Callable[[Build], set[tuple[str, ...]]]] = None
    # What the stage does with new weights, in words, where it does less than its whole work
    # (export: "binds them into the traced program"): what explain says it will run for.
    new_weights: Optional[str] = None


def _deep_merge(base: dict, extra: Mapping) -> dict:
    for name, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(name), dict):
            _deep_merge(base[name], value)
        else:
            base[name] = value
    return base


class Pipeline:
    """The ordered table of stage kinds, and everything the engine asks of the graph."""

    def __init__(self, rows: list[StageKind], fingerprint: Callable[[str], dict],
                 content_digests: Optional[Mapping[str, Callable[[str], dict]]] = None,
                 warm_imports: Optional[Callable[[str], tuple[str, ...]]] = None,
                 layout_digests: Optional[Mapping[str, Callable[[str], dict]]] = None):
        self.rows = {row.kind: row for row in rows}
        # target -> the third-party modules its stages import, which a warm process imports once
        # for all of them (cudabuild.engine.warm); () for none.
        self.warm_imports = warm_imports or (lambda target: ())
        self.cheap_fingerprint = fingerprint  # target -> cheap toolchain fingerprint (no torch)
        # File suffix -> digests of the parts of such a file ({name: sha256}, e.g. one per tensor of
        # a .safetensors shard): how a checkpoint file enters the key, so that a change is told
        # part by part. Other files enter by their sha256.
        self.content_digests = dict(content_digests or {})
        # The same, each part by what it is and not what it holds ({name: [dtype, shape]} of a
        # .safetensors shard's tensors): how a checkpoint enters the key of a stage that follows the
        # weights' layout, not their values (the trace). Other files enter by their sha256.
        self.layout_digests = dict(layout_digests or {})
        order = list(self.rows)
        for row in rows:
            for name in row.consumes:
                kind, scope = _parse(name)
                if kind not in self.rows or order.index(kind) >= order.index(row.kind):
                    raise ValueError(f"stage kind {row.kind} consumes {name}, which is not an earlier row")
                if (scope == "m") != (self.rows[kind].per_method and row.per_method) and scope != "*":
                    raise ValueError(f"stage kind {row.kind} consumes {name}: use kind[m] for the same "
                                     f"method's stage, kind[*] for every method's, kind for a once-per-build stage")
            for field_name, name in row.results.items():
                if name.partition(":")[0] not in row.consumes:
                    raise ValueError(f"stage kind {row.kind} keys {field_name} on {name}, which it does not consume")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.rows)

    def row(self, stage: Stage) -> StageKind:
        return self.rows[stage.kind]

    def applies(self, kind: str, config: Build) -> bool:
        row = self.rows[kind]
        return row.applies is None or bool(row.applies(config))

    def plan(self, config: Build) -> list[Stage]:
        """Every stage of the build, in an order that respects dependencies (the table's order)."""
        stages: list[Stage] = []
        for row in self.rows.values():
            if not self.applies(row.kind, config):
                continue
            stages += [Stage(row.kind, m) for m in config.methods] if row.per_method else [Stage(row.kind)]
        return stages

    def dependencies(self, stage: Stage, config: Build) -> list[Stage]:
        out: list[Stage] = []
        for name in self.row(stage).consumes:
            kind, scope = _parse(name)
            if not self.applies(kind, config):
                continue
            if scope == "*":
                out += [Stage(kind, m) for m in config.methods]
            else:
                out.append(Stage(kind, stage.method if scope == "m" else None))
        return out

    def results_read(self, stage: Stage, config: Build) -> list[Stage]:
        """The upstream stages whose results (digests or facets) enter the stage's key."""
        out: list[Stage] = []
        for name in self.row(stage).results.values():
            kind, scope, _ = _parse_facet(name)
            if not self.applies(kind, config):
                continue
            out += [Stage(kind, m) for m in config.methods] if scope == "*" else [
                Stage(kind, stage.method if scope == "m" else None)]
        return out

    def checkpoint_digest(self, config: Build, hasher, folder=None, layout: bool = False) -> Optional[dict]:
        """The digest of `folder` (default: the build's checkpoint), file by file and, for files
        this pipeline can split, part by part; None without a folder. With `layout`, those parts by
        what they are, not what they hold (layout_digests: a tensor's dtype and shape). `hasher`:
        the cache's file-hash memo (cudabuild.engine.hashing.FileHasher)."""
        folder = Path(folder).expanduser().resolve() if folder else config.checkpoint
        if not folder:
            return None
        if layout:
            return hasher.tree(folder, parts=self.layout_digests, tag="layout")
        return hasher.tree(folder, parts=self.content_digests)

    def final_outputs(self, stage: Stage) -> bool:
        return self.row(stage).final_outputs

    def inputs(self, stage: Stage, config: Build, read: ResultReader, fingerprint: Callable[[], dict],
               checkpoint_digest: Callable[..., Optional[dict]]) -> dict:
        """The JSON inputs whose digest is the stage's action key."""
        row = self.row(stage)

        def digest_of(kind: str, method: Optional[str], facet: str) -> Optional[str]:
            result = read(Stage(kind, method))
            if result is None or not facet:
                return result.digest if result else None
            known = facet_of(result, facet)
            # A result without the facet is keyed on whole: a stage that will run has no facets yet
            # (its result is Pending until it has run), and a record made before its stage named
            # the facet holds the part only within the whole.
            return known if known is not None else result.digest

        inputs: dict = {"stage": stage.kind, "version": row.version, "target": config.target}
        if stage.method:
            inputs["method"] = stage.method
        for field_name, name in row.results.items():
            kind, scope, facet = _parse_facet(name)
            if not self.applies(kind, config):
                continue
            if scope == "*":
                for m in config.methods:
                    inputs.setdefault("methods", {}).setdefault(m, {})[field_name] = digest_of(kind, m, facet)
            else:
                inputs[field_name] = digest_of(kind, stage.method if scope == "m" else None, facet)
        ctx = KeyContext(config, stage.method, read, fingerprint, checkpoint_digest)
        return _deep_merge(inputs, row.params(ctx))

    def upstream_of(self, path: tuple[str, ...], inputs: dict) -> Optional[str]:
        """The stage id whose result an input leaf is (compile's `graph` is edge's digest, ...)."""
        row = self.rows.get(inputs.get("stage"))
        if row is None:
            return None
        if len(path) == 1 and path[0] in row.results:
            kind, scope, _ = _parse_facet(row.results[path[0]])
            if scope != "*":
                return Stage(kind, inputs.get("method") if scope == "m" else None).id
        if len(path) == 3 and path[0] == "methods" and path[2] in row.results:
            kind, scope, _ = _parse_facet(row.results[path[2]])
            if scope == "*":
                return Stage(kind, path[1]).id
        return None

    def facet_read(self, path: tuple[str, ...], inputs: dict) -> Optional[str]:
        """The facet an input leaf holds of its upstream result ("code"), or None for its digest."""
        row = self.rows.get(inputs.get("stage"))
        field_name = path[0] if len(path) == 1 else path[2] if len(path) == 3 and path[0] == "methods" else None
        if row is None or field_name not in row.results:
            return None
        return _parse_facet(row.results[field_name])[2] or None


def facet_of(result: Result, facet: str) -> Optional[str]:
    """A named digest of part of a result (its value's `facets`), or None where it has none."""
    facets = (result.value or {}).get("facets") if isinstance(result.value, dict) else None
    return facets.get(facet) if isinstance(facets, dict) else None


def _parse_facet(name: str) -> tuple[str, str, str]:
    """"export[m]:code" -> ("export", "m", "code"); "edge[m]" -> ("edge", "m", "")."""
    name, _, facet = name.partition(":")
    return (*_parse(name), facet)


def _parse(name: str) -> tuple[str, str]:
    """"export[m]" -> ("export", "m"); "compile[*]" -> ("compile", "*"); "probe" -> ("probe", "")."""
    kind, _, scope = name.partition("[")
    return kind, scope.rstrip("]")

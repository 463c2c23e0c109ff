"""Why a stage runs, in words: differences between stage-input dicts, and `cudabuild explain`'s
forecast of what the next `doit export` would do with each stage of a build.

`reason(old, new)` is what runner.py records in a stamp when a stage runs (`spec max_autotune:
OFF -> ON`, `source recipes/x.py changed`, `toolchain triton: 3.6.0 -> 3.7.1`). `forecast(runner)`
decides each stage the way Runner.execute would (stamp holds the key: up to date; the store has
a record for it, in either tier: restorable; else it runs), from the stamps in build/ and the store's records,
without running or restoring anything. A key depends on upstream results; where an upstream will
run, its result is `Pending` and the forecast says what it waits on instead of guessing.

Must not import torch, executorch or doit, nor write to build/ or the store (loading the config
may refresh the store's file-hash and recipe-description memos, as any build does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from cudabuild.errors import CudabuildError
from cudabuild.engine.graph import Stage, plan, stage_inputs
from cudabuild.engine.hashing import digest


class Pending(str):
    """A value known only after `stage` has run (a str so it fits in inputs; equal to no real value)."""

    stage: str

    def __new__(cls, stage: str) -> "Pending":
        self = super().__new__(cls, f"<result of {stage}>")
        self.stage = stage
        return self


_MISSING = object()


@dataclass(frozen=True)
class Change:
    path: tuple[str, ...]
    old: Any = _MISSING
    new: Any = _MISSING


def diff(old: Any, new: Any, path: tuple[str, ...] = ()) -> list[Change]:
    """Each leaf that differs between two JSON values (dicts are walked, lists are leaves)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[Change] = []
        for key in sorted(set(old) | set(new), key=str):
            out.extend(diff(old.get(key, _MISSING), new.get(key, _MISSING), path + (str(key),)))
        return out
    return [] if old == new else [Change(path, old, new)]


# -- words -------------------------------------------------------------------------------------


def _value(v: Any) -> str:
    if v is _MISSING:
        return "unset"
    if isinstance(v, Pending):
        return "unknown until " + v.stage + " runs"
    if isinstance(v, str) and len(v) == 64:
        return v[:12]
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return text if len(text) <= 48 else text[:45] + "..."


def _was(c: Change) -> str:
    return f"{_value(c.old)} -> {_value(c.new)}"


def _verb(c: Change) -> str:
    return "added" if c.old is _MISSING else "removed" if c.new is _MISSING else "changed"


def upstream_of(path: tuple[str, ...], inputs: dict) -> Optional[str]:
    """The stage whose result an input leaf is (`graph` of edge is export's digest, ...)."""
    kind, method = inputs.get("stage"), inputs.get("method")
    if path == ("graph",):
        return f"edge.{method}" if kind == "compile" else f"export.{method}"
    if path == ("compiled",):
        return f"compile.{method}"
    if len(path) == 3 and path[0] == "methods" and path[2] in ("graph", "compiled"):
        return f"{'export' if path[2] == 'graph' else 'compile'}.{path[1]}"
    return None


def _toolchain_words(rest: tuple[str, ...], c: Change) -> str:
    if rest[:1] == ("packages",):
        rest = rest[1:]
    if rest == ("compiler", "stat"):
        return "toolchain compiler binary was replaced or modified"
    name = " ".join(rest) if rest[:1] == ("env",) else ".".join(rest)
    return f"toolchain {name}: {_was(c)}"


def describe(c: Change, inputs: dict) -> str:
    """One change in words; `inputs` (the new ones) says which stage and method it belongs to."""
    p = c.path
    root = p[0] if p else ""
    if c.old is _MISSING and c.new is None:  # an input this version of cudabuild added to the key
        return f"cudabuild now keys {inputs.get('stage')} on {'.'.join(p)}"
    if root == "autotune_pin":
        verb = "added" if c.old in (None, _MISSING) else "removed" if c.new is None else "changed"
        return f"pinned autotune decisions for {inputs.get('method')} {verb}"
    if root in ("fingerprint", "toolchain"):
        return _toolchain_words(p[1:], c)
    if root == "sources":
        return f"source {'/'.join(p[1:])} {_verb(c)}" if len(p) > 1 else "sources changed"
    if root == "checkpoint":
        return f"checkpoint file {'/'.join(p[1:])} {_verb(c)}" if len(p) > 1 else f"checkpoint {_was(c)}"
    if root == "options":
        return f"option {'.'.join(p[1:])}: {_was(c)}"
    if root == "specs" and len(p) == 2:
        return f"spec {p[1]}: {_was(c)}"
    if root == "methods" and len(p) == 4 and p[2] == "specs":
        return f"spec {p[1]}.{p[3]}: {_was(c)}"
    upstream = upstream_of(p, inputs)
    if upstream:
        what = _graph_name(upstream) if p[-1] == "graph" else f"result of {upstream}"
        return f"{what} changed ({_was(c)})"
    if root == "version":
        return f"cudabuild's {inputs.get('stage')} stage changed (version {_was(c)})"
    if root == "tolerances":
        return f"tolerance {'.'.join(p[1:])}: {_was(c)}"
    if root == "methods" and len(p) == 2:
        return f"method {p[1]} {_verb(c)}"
    return f"{'.'.join(p)}: {_was(c)}"


def _graph_name(stage_id: str) -> str:
    kind, _, method = stage_id.partition(".")
    return f"the {'exported' if kind == 'export' else kind} graph of {method}"


def _join(words: list[str], most: int = 3) -> str:
    return "; ".join(words[:most]) + (f"; and {len(words) - most} more" if len(words) > most else "")


def reason(old_inputs: dict | None, new_inputs: dict) -> str:
    """One line: why a stage with these inputs must run, given the inputs it last ran with."""
    if old_inputs is None:
        return "not built here before, and no cached result"
    found = [describe(c, new_inputs) for c in diff(old_inputs, new_inputs)]
    if not found:
        return "outputs missing from build/ and from the cache"
    return _join(found, 4)


# -- graphs --------------------------------------------------------------------------------------


def _node(line: str) -> list:
    try:
        entry = json.loads(line)
    except ValueError:
        return [line, ""]
    return entry if isinstance(entry, list) else [line, ""]


def _label(entry: list) -> str:
    op, target = entry[0], entry[1] if len(entry) > 1 else ""
    return f"{op} {target}" if target else str(op)


def _meta(val: Any) -> str:
    if isinstance(val, list) and val[:1] == ["T"] and len(val) >= 3:
        return f"{str(val[1]).removeprefix('torch.')}[{', '.join(map(str, val[2]))}]"
    if isinstance(val, list):
        return "(" + ", ".join(_meta(v) for v in val) + ")"
    return _value(val)


def _node_change(old_line: str, new_line: str) -> str:
    a, b = _node(old_line), _node(new_line)
    if a[:2] != b[:2]:
        return f"{_label(a)} -> {_label(b)}"
    parts = ("op", "target", "arguments", "keyword arguments", "value", "subgraph")
    differ = [name for i, name in enumerate(parts) if i >= 2 and (a[i:i + 1] != b[i:i + 1])]
    detail = f" ({_meta(a[4])} -> {_meta(b[4])})" if differ == ["value"] and len(a) > 4 and len(b) > 4 else ""
    return f"{_label(b)}: {', '.join(differ) or 'line'} changed{detail}"


def graph_difference(old: dict, new: dict) -> str:
    """The first difference between two graph.json summaries (see programs.graph_summary), in words."""
    a, b = old.get("nodes", []), new.get("nodes", [])
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at node {i}: {_node_change(x, y)}"
    if len(a) != len(b):
        longer, n = (b, "added") if len(b) > len(a) else (a, "removed")
        first = min(len(a), len(b))
        return f"{abs(len(b) - len(a))} node(s) {n} after node {first - 1}, first {_label(_node(longer[first]))}"
    for field, words in (("inputs", "its inputs"), ("outputs", "its outputs"), ("ranges", "its shape ranges")):
        if old.get(field) != new.get(field):
            return f"same nodes, {words} changed"
    for field, what in (("state", "weight"), ("constants", "constant")):
        o, n = old.get(field, {}), new.get(field, {})
        for name in sorted(set(o) | set(n)):
            if o.get(name) != n.get(name):
                verb = "added" if name not in o else "removed" if name not in n else "changed"
                return f"same nodes, {what} {name} {verb}"
    return "same summary, different digest (a different graph_summary version?)"


# -- the forecast ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forecast:
    stage: str
    verdict: str  # up to date | restorable | run | wait (the outcome depends on an upstream's result)
    words: str

    def line(self, width: int = 0) -> str:
        return f"{self.stage:<{width}}  {self.words}"


# Probe fields the cheap fingerprint determines exactly (toolchain.probe computes them the same way).
_EXACT = {"target": ("target",), "python": ("python",), "machine": ("machine",), "env": ("env",),
          "triton": ("packages", "triton"), "executorch": ("packages", "executorch"),
          "inductor_root": ("inductor_root",)}
# Fields probe measures itself: unchanged when their fingerprint source is, otherwise unknown.
_MEASURED = {"torch": ("packages", "torch"), "compiler": ("compiler",), "cuda": ("cuda",)}


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree.get(key, _MISSING) if isinstance(tree, dict) else _MISSING
    return tree


def predict_probe_value(old_stamp: Optional[dict], fingerprint: dict) -> dict:
    """What probe will report, from the new cheap fingerprint and its last report; Pending where unknown."""
    old_value = (old_stamp or {}).get("value") or {}
    old_fp = ((old_stamp or {}).get("inputs") or {}).get("fingerprint") or {}
    value = {field: _at(fingerprint, path) for field, path in _EXACT.items()}
    for field, path in _MEASURED.items():
        if field == "cuda" and fingerprint.get("target") != "cuda":
            continue
        same = old_stamp is not None and field in old_value and _at(old_fp, path) == _at(fingerprint, path)
        value[field] = old_value[field] if same else Pending("probe")
    return value


def _pending(value: Any) -> set[str]:
    if isinstance(value, Pending):
        return {value.stage}
    if isinstance(value, dict):
        return set().union(*(_pending(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_pending(v) for v in value)) if value else set()
    return set()


def _names(stages: set[str], conjunction: str) -> str:
    names = sorted(stages)
    if len(names) > 2:
        names = names[:2] + [f"{len(names) - 2} more"]
    return ", ".join(names[:-1]) + f" {conjunction} " + names[-1] if len(names) > 1 else names[0]


def _if_changes(stages: set[str]) -> str:
    return f"{_names(stages, 'or')} changes its result"


def _results_of(stages: set[str]) -> str:
    return f"{_names(stages, 'and')}'s result" if len(stages) == 1 else f"the results of {_names(stages, 'and')}"


class _Graphs:
    """Old graph.json summaries, found through the store's records by (stage, digest)."""

    def __init__(self, store):
        self.store = store
        self._by_digest: Optional[dict] = None

    def outputs_for(self, stage_id: str, stage_digest: str) -> Optional[dict]:
        if self._by_digest is None:
            self._by_digest = {(r.get("stage"), r.get("digest")): r.get("outputs", {}) for _, r in self.store.records()}
        return self._by_digest.get((stage_id, stage_digest))

    def summary(self, outputs: Optional[dict]) -> Optional[dict]:
        sha = (outputs or {}).get("graph.json")
        if not sha:
            return None
        try:
            return json.loads(self.store.read_bytes(sha))
        except (CudabuildError, ValueError):
            return None


def _describe_with_graphs(c: Change, inputs: dict, predicted: dict, graphs: _Graphs) -> str:
    upstream = upstream_of(c.path, inputs)
    # The node-level difference is told where the graph is consumed first (edge, compile); the
    # stages that also key on it (package, verify) just say it changed.
    direct = inputs.get("stage") in ("edge", "compile")
    if upstream and c.path[-1] == "graph" and not direct:
        return f"{_graph_name(upstream)} changed"
    if upstream and c.path[-1] == "graph" and isinstance(c.old, str) and not isinstance(c.new, Pending):
        new = graphs.summary((predicted.get(upstream) or {}).get("outputs"))
        old = graphs.summary(graphs.outputs_for(upstream, c.old))
        if new is not None and old is not None:
            return f"{_graph_name(upstream)} changed: {graph_difference(old, new)}"
        if new is not None:
            return f"{_graph_name(upstream)} changed ({_was(c)}; the previous graph is no longer in the cache)"
    return describe(c, inputs)


def forecast(runner) -> list[Forecast]:
    """What `doit export` would do with each stage of runner.config's build, and why; runs nothing.

    `runner` is a cudabuild.engine.runner.Runner (stamps, fingerprint, store); only its reading methods are used.
    """
    config, store = runner.config, runner.store
    predicted: dict[str, Optional[dict]] = {}  # stage id -> the stamp/record its dependents will read
    graphs = _Graphs(store)
    out = []
    for stage in plan(config):
        old = runner.read_stamp(stage)
        inputs = stage_inputs(stage, config, lambda s: predicted.get(s.id), runner.fingerprint, runner.checkpoint_digest)
        waits = _pending(inputs)
        verdict = None
        if not waits:
            key = digest(inputs)
            if old and old.get("key") == key and runner.finals_intact(old):
                predicted[stage.id] = old
                verdict = Forecast(stage.id, "up to date", "up to date")
            elif (found := store.locate_record(key))[0] is not None:
                record, tier = found
                predicted[stage.id] = record
                note = "; its files in build/ are missing or modified" if old and old.get("key") == key else ""
                saves = record.get("seconds") or 0.0
                saves = f"saves {saves:.1f}s" if saves >= 0.1 else ""
                detail = "; ".join(x for x in (saves, note.lstrip("; ")) if x)
                source = "cache" if tier == "local" else f"the shared cache {store.remote.where}"
                verdict = Forecast(stage.id, "restorable", f"restorable from {source}" + (f" ({detail})" if detail else ""))
        if verdict is None:
            predicted[stage.id] = {
                "digest": Pending(stage.id), "outputs": None,
                "value": predict_probe_value(old, runner.fingerprint()) if stage.kind == "probe" else None,
            }
            verdict = _will_run(stage, old, inputs, waits, predicted, graphs)
        out.append(verdict)
    return out


def _will_run(stage: Stage, old: Optional[dict], inputs: dict, waits: set[str], predicted: dict, graphs: _Graphs) -> Forecast:
    if old is None:
        if waits:
            return Forecast(stage.id, "wait", f"not built here; runs or restores depending on {_results_of(waits)}")
        return Forecast(stage.id, "run", "will run: not built here before, and not in the cache")
    known = [c for c in diff(old.get("inputs") or {}, inputs) if not _pending(c.new)]
    words = [_describe_with_graphs(c, inputs, predicted, graphs) for c in known]
    if not waits:
        why = _join(words) if words else "its files in build/ are missing or modified, and the cache has no copy"
        return Forecast(stage.id, "run", f"will run because {why}")
    if words:
        return Forecast(stage.id, "run", f"will run because {_join(words)} (or restore, depending on {_results_of(waits)})")
    return Forecast(stage.id, "wait", f"will run if {_if_changes(waits)} (early cutoff may stop it)")

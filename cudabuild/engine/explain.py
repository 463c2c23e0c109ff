"""Why a stage runs, in words: differences between stage-input dicts, and `cudabuild explain`'s
forecast of what the next `doit export` would do with each stage of a build.

`reason(old, new, pipeline)` is what runner.py records in a stamp when a stage runs (`spec
max_autotune: OFF -> ON`, `source recipes/x.py changed`, `toolchain triton: 3.6.0 -> 3.7.1`; the
pipeline says which upstream stage an input is the result of). `forecast(runner)`
asks Runner.decide, the one up-to-date decision a build makes, about each stage, with predicted
upstream results and a store lookup that changes nothing, and words the verdicts. A key depends on
upstream results; where an upstream will run, its result is `Pending` and the forecast says what
it waits on instead of guessing, with one prediction: a change of nothing but the weights' values
(an option the recipe declares as such, a seed: the rows' `values_only`) keeps every facet of the
results it reaches (export's `code`), so the stages keyed on those facets (edge, compile) are told
up to date, their code unchanged, and those keyed on the weights (blob, package, verify) as
running for the new weights, with what a row says it does with them (export: "binds them into
the traced program"); a stage up to date whose result such a stage keys on (the trace) is told
up to date for that reason. The build itself computes the facets, and a wrong forecast costs a
compile, never a wrong artifact.

Must not import torch, executorch or doit, nor the runner (it is handed one), nor write to build/
or the store (loading the config may refresh the store's file-hash and recipe-description memos,
as any build does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from cudabuild.errors import CudabuildError
from cudabuild.engine.graph import Pending, Pipeline, Result, pending_in

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


def _toolchain_words(rest: tuple[str, ...], c: Change) -> str:
    if rest[:1] == ("packages",):
        rest = rest[1:]
    if rest == ("compiler", "stat"):
        return "toolchain compiler binary was replaced or modified"
    name = " ".join(rest) if rest[:1] == ("env",) else ".".join(rest)
    return f"toolchain {name}: {_was(c)}"


def describe(c: Change, inputs: dict, pipeline: Pipeline) -> str:
    """One change in words; `inputs` (the new ones) says which stage and method it belongs to, and
    the pipeline which upstream stage an input names."""
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
        if len(p) > 2:  # a part of a file: a tensor of a .safetensors shard
            return f"checkpoint tensor {'/'.join(p[2:])} ({p[1]}) {_verb(c)}"
        return f"checkpoint file {p[1]} {_verb(c)}" if len(p) > 1 else f"checkpoint {_was(c)}"
    if root == "options":
        return f"option {'.'.join(p[1:])}: {_was(c)}"
    if root == "specs" and len(p) == 2:
        return f"spec {p[1]}: {_was(c)}"
    if root == "methods" and len(p) == 4 and p[2] == "specs":
        return f"spec {p[1]}.{p[3]}: {_was(c)}"
    upstream = pipeline.upstream_of(p, inputs)
    if upstream:
        what = (_graph_name(upstream) if p[-1] == "graph" else _weights_name(upstream) if p[-1] == "weights"
                else f"result of {upstream}")
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
    return f"the {({'export': 'exported', 'trace': 'traced'}).get(kind, kind)} graph of {method}"


def _weights_name(stage_id: str) -> str:
    kind, _, method = stage_id.partition(".")
    return f"the weights of {method}" if method else f"the weights from {kind}"


def _join(words: list[str], most: int = 3) -> str:
    return "; ".join(words[:most]) + (f"; and {len(words) - most} more" if len(words) > most else "")


def reason(old_inputs: dict | None, new_inputs: dict, pipeline: Pipeline) -> str:
    """One line: why a stage with these inputs must run, given the inputs it last ran with."""
    if old_inputs is None:
        return "not built here before, and no cached result"
    found = [describe(c, new_inputs, pipeline) for c in diff(old_inputs, new_inputs)]
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


def _names(stages: set[str], conjunction: str) -> str:
    names = sorted(stages)
    if len(names) > 2:
        names = names[:2] + [f"{len(names) - 2} more"]
    return ", ".join(names[:-1]) + f" {conjunction} " + names[-1] if len(names) > 1 else names[0]


def _if_changes(stages: set[str], what: str = "its result") -> str:
    return f"{_names(stages, 'or')} changes {what}"


def _results_of(stages: set[str]) -> str:
    return f"{_names(stages, 'and')}'s result" if len(stages) == 1 else f"the results of {_names(stages, 'and')}"


class _Graphs:
    """Old graph.json summaries, found through the store's records by (stage, digest)."""

    def __init__(self, store):
        self.store = store
        self._by_digest: Optional[dict] = None

    def outputs_for(self, stage_id: str, stage_digest: str) -> Optional[dict]:
        """A record's outputs by its stage and its digest, or one of its facets."""
        if self._by_digest is None:
            self._by_digest = {}
            for _, r in self.store.actions.records():
                facets = (r.get("value") or {}).get("facets") if isinstance(r.get("value"), dict) else None
                for known in (*(facets.values() if isinstance(facets, dict) else ()), r.get("digest")):
                    self._by_digest[(r.get("stage"), known)] = r.get("outputs", {})
        return self._by_digest.get((stage_id, stage_digest))

    def summary(self, outputs: Optional[dict]) -> Optional[dict]:
        sha = (outputs or {}).get("graph.json")
        if not sha:
            return None
        try:
            return json.loads(self.store.objects.read_bytes(sha))
        except (CudabuildError, ValueError):
            return None


def _describe_with_graphs(c: Change, inputs: dict, predicted: dict, graphs: _Graphs, pipeline: Pipeline) -> str:
    upstream = pipeline.upstream_of(c.path, inputs)
    # The node-level difference is told where the graph is consumed first; the stages that also
    # key on it just say it changed.
    row = pipeline.rows.get(inputs.get("stage"))
    direct = row is not None and row.explains_graph
    if upstream and c.path[-1] == "graph" and not direct:
        return f"{_graph_name(upstream)} changed"
    if upstream and c.path[-1] == "graph" and isinstance(c.old, str) and not isinstance(c.new, Pending):
        new = graphs.summary(predicted[upstream].outputs if upstream in predicted else None)
        old = graphs.summary(graphs.outputs_for(upstream, c.old))
        if new is not None and old is not None:
            return f"{_graph_name(upstream)} changed: {graph_difference(old, new)}"
        if new is not None:
            return f"{_graph_name(upstream)} changed ({_was(c)}; the previous graph is no longer in the cache)"
    return describe(c, inputs, pipeline)


def forecast(runner) -> list[Forecast]:
    """What `doit export` would do with each stage of runner.config's build, and why; runs nothing.

    `runner` is a cudabuild.engine.runner.Runner; only its reading methods are used.
    """
    config, store, pipeline = runner.config, runner.store, runner.pipeline
    predicted: dict[str, Result] = {}  # stage id -> the result its dependents will read
    new_weights: dict[str, str] = {}  # stage id -> the change of weights alone it will run for, in words
    kept: dict[str, str] = {}  # stage id -> the same, for stages up to date although new weights reach them
    graphs = _Graphs(store)
    out = []
    for stage in pipeline.plan(config):
        decision = runner.decide(stage, read=lambda s: predicted.get(s.id), find=store.actions.lookup)
        old = decision.old
        if decision.verdict in ("cached", "restorable"):
            reached = sorted({new_weights.get(s.id) or kept.get(s.id) for s in pipeline.dependencies(stage, config)}
                             - {None})
            if reached:
                kept[stage.id] = "; ".join(reached)
        if decision.verdict == "cached":
            predicted[stage.id] = old.result
            words = f"up to date (its code is unchanged: only the weights change, {kept[stage.id]})" if stage.id in kept \
                else "up to date"
            out.append(Forecast(stage.id, "up to date", words))
            continue
        if decision.verdict == "restorable":
            record = decision.record
            predicted[stage.id] = Result(record["digest"], record.get("value"), record.get("outputs"))
            note = "its files in build/ are missing or modified" if old and old.key == decision.key else ""
            saves = record.get("seconds") or 0.0
            saves = f"saves {saves:.1f}s" if saves >= 0.1 else ""
            detail = "; ".join(x for x in (saves, note) if x)
            source = "cache" if decision.tier == "local" else f"the shared cache {store.remote.where}"
            out.append(Forecast(stage.id, "restorable", f"restorable from {source}" + (f" ({detail})" if detail else "")))
            continue
        predict = pipeline.row(stage).predict_value
        value = None
        if predict is not None:
            value = predict(old.value if old else None, old.inputs.get("fingerprint") if old else None, runner.fingerprint())
        why = _weights_alone(decision, new_weights, config, pipeline)
        if why is not None:
            new_weights[stage.id] = why
            facets = (old.value or {}).get("facets") if isinstance(old.value, dict) else None
            if facets:  # new weights, the same code: the facets stay
                value = dict(value or {}, facets=dict(facets))
        predicted[stage.id] = Result(Pending(stage.id), value, None)
        out.append(_will_run(decision, predicted, graphs, pipeline, new_weights))
    return _untouched_by_new_weights(out, runner, new_weights, kept)


def _untouched_by_new_weights(out: list[Forecast], runner, new_weights: dict, kept: dict) -> list[Forecast]:
    """An up-to-date stage whose result a stage running for new weights keys on (the trace that
    export binds them into) is said to be up to date for that reason."""
    config, pipeline = runner.config, runner.pipeline
    readers: dict[str, list[str]] = {}
    for stage in pipeline.plan(config):
        if stage.id in new_weights:
            for upstream in pipeline.results_read(stage, config):
                readers.setdefault(upstream.id, []).append(new_weights[stage.id])
    return [Forecast(f.stage, f.verdict, f"up to date (the new weights do not change it: "
                                         f"{'; '.join(dict.fromkeys(readers[f.stage]))})")
            if f.verdict == "up to date" and f.stage in readers and f.stage not in kept else f for f in out]


def not_in_cache(runner, forecasts: list[Forecast]) -> list[str]:
    """The stages the forecast calls up to date (their outputs in build/) whose record the cache
    does not hold: an emptied cache, or another CUDABUILD_CACHE_DIR than the one that built build/."""
    current = {f.stage for f in forecasts if f.verdict == "up to date"}
    stamps = {s.id: runner.read_stamp(s) for s in runner.pipeline.plan(runner.config) if s.id in current}
    return [sid for sid, stamp in stamps.items() if stamp and runner.store.actions.lookup(stamp.key)[0] is None]


def not_cached_words(where: str, missing: int, up_to_date: int) -> str:
    """What explain and a build's summary say of stages up to date in build/ that the cache lacks."""
    some = "none" if missing == up_to_date else f"{missing} of the {up_to_date}"
    return (f"{where}/ is up to date, and the cache holds {some} of its stages (emptied, or another "
            "CUDABUILD_CACHE_DIR): a change rebuilds them from scratch")


def _weights_alone(decision, new_weights: dict, config, pipeline: Pipeline) -> Optional[str]:
    """When every input of the stage that changes is a change of the weights' values alone (an
    input its row names `values_only`, or the result of a stage that runs for new weights), those
    changes in words; else None."""
    old = decision.old
    if old is None:
        return None
    row = pipeline.row(decision.stage)
    alone = row.values_only(config) if row.values_only else set()
    changes = diff(old.inputs, decision.inputs)
    whys: list[str] = []
    for c in changes:
        upstream = pipeline.upstream_of(c.path, decision.inputs)
        if c.path in alone:
            whys.append(describe(c, decision.inputs, pipeline))
        elif upstream in new_weights:
            whys.append(new_weights[upstream])
        else:
            return None
    return "; ".join(dict.fromkeys(whys)) if whys else None


def _will_run(decision, predicted: dict, graphs: _Graphs, pipeline: Pipeline, new_weights: dict) -> Forecast:
    stage, old, inputs, waits = decision.stage, decision.old, decision.inputs, set(decision.waits)
    if old is None:
        if waits:
            return Forecast(stage.id, "wait", f"not built here; runs or restores depending on {_results_of(waits)}")
        return Forecast(stage.id, "run", "will run: not built here before, and not in the cache")
    if stage.id in new_weights:
        does = pipeline.row(stage).new_weights
        return Forecast(stage.id, "run", f"will run for the new weights ({new_weights[stage.id]})"
                                         + (f": {does}" if does else ""))
    known = [c for c in diff(old.inputs, inputs) if not pending_in(c.new)]
    words = [_describe_with_graphs(c, inputs, predicted, graphs, pipeline) for c in known]
    if not waits:
        why = _join(words) if words else "its files in build/ are missing or modified, and the cache has no copy"
        return Forecast(stage.id, "run", f"will run because {why}")
    if words:
        return Forecast(stage.id, "run", f"will run because {_join(words)} (or restore, depending on {_results_of(waits)})")
    what = "its code" if _reads_facets_only(inputs, pipeline) else "its result"
    return Forecast(stage.id, "wait", f"will run if {_if_changes(waits, what)} (early cutoff may stop it)")


def _reads_facets_only(inputs: dict, pipeline: Pipeline) -> bool:
    """Whether every pending upstream input of a stage holds a facet (export's code), not a digest."""
    leaves = _pending_paths(inputs)
    return bool(leaves) and all(pipeline.facet_read(p, inputs) for p in leaves)


def _pending_paths(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, Pending):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _pending_paths(v, path + (str(k),))]
    return []

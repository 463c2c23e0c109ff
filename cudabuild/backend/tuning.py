"""Autotuning decisions as a stored artifact, so a compile whose tuning inputs did not change does no
benchmarking, and `autotune=pin` can freeze them in the repository for exact replay.

Inductor keeps its decisions as files in its cache dir: `<xx>/<kernel hash>.best_config` next to
each tuned Triton kernel (accepted only when its configs hash still matches) and
`cache/<system hash>` holding max-autotune GEMM timings. Every compile runs in a private inductor
dir (see stages/compile.py), so what that dir holds afterwards is exactly this compile's
decisions: `harvest` collects them, `restore` puts them back before a later compile.

Decisions are keyed by the *tuning key*: the edge graph's digest, the toolchain and the specs that
change what is tuned (not packaging specs), and live in the store as `doc:tune:<key>`. A pinned
file `recipes/<model>.autotune.json` ({target: {method: {"tuning_key", "files"}}}) wins over the
store, and its entry's digest is part of the compile key, so editing or checking out another
pin rebuilds. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

from cudabuild.engine.files import atomic_write_text
from cudabuild.engine.hashing import digest
from cudabuild.specs import tuning_specs

def tuning_key(graph_digest: Optional[str], toolchain: Mapping, specs: Mapping[str, str]) -> str:
    return digest({"graph": graph_digest, "toolchain": dict(toolchain), "specs": tuning_specs(specs)})


def _is_decision(rel: Path) -> bool:
    return rel.suffix == ".best_config" or (len(rel.parts) == 2 and rel.parts[0] == "cache")


def harvest(cache_dir: Path) -> dict[str, str]:
    """{relative path: text} of every tuning decision file under an inductor cache dir."""
    found = {}
    if not cache_dir.is_dir():
        return found
    for path in sorted(cache_dir.rglob("*")):
        rel = path.relative_to(cache_dir)
        if path.is_file() and _is_decision(rel):
            try:
                found[str(rel)] = path.read_text()
            except UnicodeDecodeError:
                continue
    return found


def restore(cache_dir: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = (cache_dir / rel).resolve()
        if not path.is_relative_to(cache_dir.resolve()):
            continue  # a pin file is data from the repository: never write outside the cache dir
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def pin_path(project: Path, model: str) -> Path:
    return project / "recipes" / f"{model}.autotune.json"


def read_pins(project: Path, model: str) -> dict:
    path = pin_path(project, model)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        from cudabuild.errors import CudabuildError

        raise CudabuildError(f"{path.relative_to(project)} is not valid JSON; fix it or delete it to re-tune") from None


def pinned(project: Path, model: str, target: str, method: str) -> Optional[dict]:
    return read_pins(project, model).get(target, {}).get(method)


def pinned_digest(project: Path, model: str, target: str, method: str) -> Optional[str]:
    entry = pinned(project, model, target, method)
    return digest(entry["files"]) if entry else None


def write_pins(project: Path, model: str, target: str, entries: Mapping[str, dict]) -> Path:
    """Merge {method: {"tuning_key", "files"}} for one target into the pin file, atomically."""
    pins = read_pins(project, model)
    pins.setdefault(target, {}).update(entries)
    path = pin_path(project, model)
    atomic_write_text(path, json.dumps(pins, indent=1, sort_keys=True) + "\n")
    return path


def pin_autotune(runner) -> Path:
    """`autotune=pin`: write every method's tuning decisions to recipes/<model>.autotune.json.

    The compile stamps are then re-keyed to the inputs that name the new pin: replaying the
    decisions a compile just made reproduces that compile, so nothing is rebuilt for it.
    """
    from cudabuild.engine.graph import Stage
    from cudabuild.engine.rekey import rekey

    config = runner.config
    entries = {}
    for method in config.methods:
        compiled = Stage("compile", method)
        data = json.loads(runner.io(compiled).read(compiled, "autotune.json"))
        entries[method] = {"tuning_key": data["tuning_key"], "files": data["files"]}
    path = write_pins(config.project, config.model, config.target, entries)
    for method in config.methods:
        rekey(runner, Stage("compile", method))
    return path

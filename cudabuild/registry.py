"""The recipe registry: which models exist, and what each recipe declares, without importing torch
when nothing changed.

Owns finding recipes, their sources, and the memos of their description and `resolve`. Must not
touch: a build's settings (cudabuild.config merges them), a key's composition (cudabuild.pipeline),
torch but through importing a recipe whose sources changed.

`recipes/<name>.py` is model `<name>`. A recipe's *sources* are its file plus every project-local
module it imports, found statically (an AST walk, transitively), so a no-op build can check them
by stat alone. Its *description* (method names, declared specs, option defaults) needs the recipe
imported, which imports torch; it is memoised in the store under the sources' content hashes and
recomputed only when one of them changes. So is what a recipe's `resolve` makes of the options (also
keyed by the options and what the folders they name hold: config.json, safetensors headers).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Optional

from cudabuild import options as option_table
from cudabuild.errors import InvalidConfig, RecipeError, UnknownModel
from cudabuild.engine.hashing import FileHasher, code_digest, digest
from cudabuild.formats.safetensors_parts import header_digest

# Bump when the description's shape changes, so old memo entries are not reused.
DESCRIPTION_VERSION = 6


def recipes_dir(project: Path) -> Path:
    return project / "recipes"


def list_models(project: Path) -> list[str]:
    folder = recipes_dir(project)
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def recipe_path(project: Path, model: str) -> Path:
    path = recipes_dir(project) / f"{model}.py"
    if not path.is_file():
        known = ", ".join(list_models(project)) or "none"
        raise UnknownModel(f"unknown model '{model}'; known models: {known} (recipes live in {recipes_dir(project)})")
    return path


def _module_file(project: Path, dotted: str) -> Optional[Path]:
    parts = dotted.split(".")
    base = project.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(path: Path, project: Path) -> list[Path]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as e:
        rel = path.relative_to(project) if path.is_relative_to(project) else path
        raise RecipeError(f"{rel}:{e.lineno}: syntax error: {e.msg}") from None
    found: list[Path] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            # A package's __init__ runs on import of any submodule: include every parent too.
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                file = _module_file(project, ".".join(parts[:i]))
                if file is not None:
                    found.append(file)
    return found


def source_files(project: Path, model: str) -> list[Path]:
    """The recipe file and the project modules it imports, transitively (static analysis)."""
    return module_closure(project, recipe_path(project, model))


def module_closure(project: Path, start: Path) -> list[Path]:
    """`start` and the project modules it imports, transitively (static analysis)."""
    seen: dict[Path, None] = {}
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = None
        todo.extend(p for p in _imports_of(path, project) if p not in seen)
    return sorted(seen)


def source_digests(project: Path, model: str, hasher: FileHasher) -> dict[str, str]:
    """Each source's code digest (hashing.code_digest: comments and blank lines left out), memoised
    by its stat like a file hash: a comment edit reruns nothing. (The exported program's stack
    traces may then name lines from before such an edit; no artifact depends on them.)"""
    return {str(p.relative_to(project)): hasher.derived(p, "code", code_digest) for p in source_files(project, model)}


def load_recipe(project: Path, model: str):
    """Import recipes/<model>.py and return its RECIPE (imports torch through the recipe)."""
    path = recipe_path(project, model)
    if str(project) not in sys.path:
        sys.path.insert(0, str(project))
    module_name = f"_cudabuild_recipe_{model}"
    if module_name in sys.modules:
        return sys.modules[module_name].RECIPE
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    rel = path.relative_to(project)
    # Registered before it runs: dataclasses (and pickling) look the module up while it executes.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[module_name]
        raise RecipeError(f"{rel}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # the recipe's own code failed at import
        del sys.modules[module_name]
        raise RecipeError(f"{_where(e, path, rel)}: recipe failed to import: {type(e).__name__}: {e}") from None
    recipe = getattr(module, "RECIPE", None)
    if recipe is None:
        del sys.modules[module_name]
        raise RecipeError(f"{rel}: defines no RECIPE = Recipe(...)")
    return recipe


def _where(error: BaseException, path: Path, rel: Path) -> str:
    """`file:line` of the deepest frame of the traceback that is in the recipe file."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{rel}:{line}" if line else str(rel)


def describe(project: Path, model: str, store, target: str) -> dict:
    """What the recipe declares for `target` (its form for that target), as JSON data; memoised in
    the store by source content."""
    sources = source_digests(project, model, store.hasher)
    memo_key = f"recipe:{model}:" + digest({"v": DESCRIPTION_VERSION, "sources": sources, "target": target})
    cached = store.actions.get_json(memo_key)
    if cached is not None:
        return cached
    recipe = load_recipe(project, model).for_target(target)
    table = option_table.table(recipe.options)
    description = {
        "model": model,
        "target": target,
        "sources": sources,
        "methods": [m.name for m in recipe.methods],
        "options": option_table.defaults(table, target),
        "option_table": option_table.described(table),
        "resolves": recipe.resolve is not None,
        "specs": {t: dict(v) for t, v in recipe.specs.items()},
        "method_specs": {m.name: {t: dict(v) for t, v in m.specs.items()} for m in recipe.methods},
        "tolerances": dict(recipe.tolerances),
        "quantize": _quantize_description(project, recipe.quantize, table, target),
        "samplers": {m.name: {"temperature_input": m.sampler.temperature_input,
                              "greedy_temperature": m.sampler.greedy_temperature}
                     for m in recipe.methods if m.sampler is not None},
        "strict_export": recipe.strict_export,
        "lowering": recipe.lowering.as_data() if recipe.lowering else None,
        "weights_options": [o.name for o in table if o.values_only],
    }
    store.actions.put_json(memo_key, description)
    return description


def _quantize_description(project: Path, quantize, table: option_table.Table, target: str) -> Optional[dict]:
    """The quantize stage's declaration as data: the options and folders that key it (the rows of
    the table marked `quantize` that apply to `target`), and the sources of the module that defines
    it (the only code its key follows)."""
    if quantize is None:
        return None
    # Found by module name among the project's files, as the recipe's own sources are.
    path = _module_file(project, quantize.run.__module__)
    if path is None:
        raise RecipeError(f"the quantize step of a recipe must be defined in a module of the project, "
                          f"not {quantize.run.__module__}")
    truth = _module_file(project, quantize.truth.__module__) if quantize.truth is not None else None
    keyed = [o for o in table if o.quantize and o.applies_to(target)]
    return {"options": [o.name for o in keyed if not o.folder], "folders": [o.name for o in keyed if o.folder],
            "on_device": quantize.on_device,
            "sources": [str(p.relative_to(project)) for p in module_closure(project, path)],
            "truth_sources": [str(p.relative_to(project)) for p in module_closure(project, truth)] if truth else None}


def resolve_options(project: Path, description: dict, options: option_table.Options, store) -> option_table.Options:
    """The resolved options (resolved_build's)."""
    return resolved_build(project, description, options, store)[0]


def resolved_build(project: Path, description: dict, options: option_table.Options,
                   store) -> tuple[option_table.Options, Optional[int]]:
    """The recipe's `resolve(options)`, memoised in the store by the sources, the options and what
    the folders the options name hold (config.json and index files by content, each .safetensors
    file by its header: stat-memoised, so a no-op build reads nothing and a touched shard only its
    header). A no-op build therefore imports no torch. What resolve refused (an InvalidConfig, its
    problems) is memoised too, and raised again."""
    if not description.get("resolves"):
        return options, None
    model = description["model"]
    folders = [o["name"] for o in description.get("option_table", ()) if o.get("folder")]
    memo_key = f"options:{model}:" + digest({
        "v": DESCRIPTION_VERSION, "sources": description["sources"], "target": description["target"], "options": dict(options),
        "folders": {name: folder_digest(options.get(name), store.hasher) for name in folders if options.get(name)},
    })
    resolved = store.actions.get_json(memo_key)
    if resolved is None:
        recipe = load_recipe(project, model).for_target(description["target"])
        try:
            resolved = {"options": dict(recipe.resolve(options))}
            if recipe.weights_bytes is not None:
                resolved["weights_bytes"] = int(recipe.weights_bytes(options.replace(**resolved["options"])))
        except InvalidConfig as e:
            resolved = {"problems": e.problems}
        store.actions.put_json(memo_key, resolved)
    if "problems" in resolved:
        raise InvalidConfig(resolved["problems"])
    # typed as given (the table's order), memo or not
    return options.replace(**{name: resolved["options"][name] for name in options}), resolved.get("weights_bytes")


def folder_digest(folder, hasher: FileHasher) -> dict:
    """What a recipe's resolve may read of a folder an option names: its .json files by content,
    its .safetensors files by their headers (not their data), the names of the rest."""
    root = Path(str(folder)).expanduser()
    if not root.is_dir():
        return {"missing": str(root)}
    out = {}
    for path in sorted(root.iterdir()):
        if path.suffix == ".json" and path.is_file():
            out[path.name] = hasher(path)
        elif path.suffix == ".safetensors" and path.is_file():
            out[path.name] = hasher.derived(path, "header", header_digest)
        else:
            out[path.name] = None
    return {"path": str(root.resolve()), "files": out}

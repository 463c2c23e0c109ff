"""The package's imports, read from the source (ast), not by importing it: no module imports itself
back through others, at module level or inside a function, and the engine imports nothing above it.

An edge is every `import` and `from ... import` anywhere in a file (functions, `if TYPE_CHECKING:`
blocks, `importlib.import_module("literal")` too); `from a import b` is an edge to `a.b` when that
is a module, and importing a module imports its parent packages as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "cudabuild"
# What the engine must not import: it takes a plain description of the build (graph.Build) and
# its stage table from its caller.
ABOVE_THE_ENGINE = ("cudabuild.config", "cudabuild.specs", "cudabuild.registry", "cudabuild.pipeline", "cudabuild.backend")


def module_files() -> dict[str, Path]:
    """{dotted module name: file} of every module under cudabuild/ (a package by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_names(name: str, path: Path):
    """(line, dotted name) of everything the file imports; `from a import b` gives a.b (the caller
    keeps whichever of a and a.b is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, `level - 1` packages up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            yield node.lineno, node.args[0].value


def _with_parents(target: str, modules) -> list[str]:
    """The modules importing `target` loads: it (or its longest prefix that is a module) and its packages."""
    parts = target.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules]


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {module it imports: the first line that does}} within the package."""
    modules = module_files()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, target in _imported_names(name, path):
            if target.split(".")[0] != "cudabuild":
                continue
            for module in _with_parents(target, modules):
                if module != name:
                    edges.setdefault(module, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One cycle, as [a, b, ..., a], or [] when there is none (depth-first, three colours)."""
    state: dict[str, str] = {}  # module -> "open" (on the current path) | "done"
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, {})):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def _described(cycle: list[str], graph) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_walk_sees_module_level_function_level_and_submodule_imports():
    graph = import_graph()
    assert "cudabuild.engine.store" in graph["cudabuild.engine.runner"]  # module level
    assert "cudabuild.engine.tiers.factory" in graph["cudabuild.engine.store"]  # inside a function
    assert "cudabuild.engine.console.terminal" in graph["cudabuild.engine.runner"]  # `from package import module`
    assert "cudabuild.engine.tiers" in graph["cudabuild.engine.tiers.redis"]  # a module's packages load first
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == ["a", "b", "c", "a"]


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert not cycle, f"import cycle: {_described(cycle, graph)}"


def test_the_engine_imports_nothing_above_it():
    reaching: dict[str, str] = {}  # file:line -> what it imports (the first name, for `from a import b`)
    for name, path in module_files().items():
        if name == "cudabuild.engine" or name.startswith("cudabuild.engine."):
            for line, target in _imported_names(name, path):
                if any(target == above or target.startswith(above + ".") for above in ABOVE_THE_ENGINE):
                    reaching.setdefault(f"{path.relative_to(REPO)}:{line}", target)
    assert not reaching, "the engine reaches up: " + "; ".join(f"{at} imports {what}" for at, what in reaching.items())


def test_no_storage_tier_imports_the_console_or_knows_inductor():
    """A tier stores records, blobs and leases; what it warns through and what inductor reads are its
    caller's (cudabuild.engine.store hands it the console's warning, the compile stage sets inductor's
    variables)."""
    reaching = []
    for name, path in module_files().items():
        if name.startswith("cudabuild.engine.tiers"):
            reaching += [f"{path.relative_to(REPO)}:{line} imports {target}" for line, target in _imported_names(name, path)
                         if target.startswith("cudabuild.engine.console")]
            if "TORCHINDUCTOR_" in path.read_text():
                reaching.append(f"{path.relative_to(REPO)} names inductor's variables")
    assert not reaching, "; ".join(reaching)


def test_a_storage_tier_imports_nothing_that_builds_on_it():
    """The tiers sit below the store and the cache tools: a tier imports its own package, the
    record check and the hashing it shares, never the stores or cache_admin above it (whose
    `cache gc --remote` calls down into tiers.s3.gc)."""
    below = ("cudabuild.engine.tiers", "cudabuild.engine.records", "cudabuild.engine.hashing", "cudabuild.errors",
             "cudabuild.engine", "cudabuild")
    reaching = [f"{name} imports {target}" for name, edges in import_graph().items()
                if name.startswith("cudabuild.engine.tiers") for target in edges
                if not (target in below or target.startswith("cudabuild.engine.tiers."))]
    assert not reaching, "; ".join(reaching)


def test_a_stage_describes_itself_without_the_runner():
    """Backend stages take a StageContext and return a StageResult (cudabuild.engine.context); the
    runner, which decides and stores, is the engine's."""
    graph = import_graph()
    stages = [name for name in graph if name.startswith("cudabuild.backend")]
    assert stages and not [name for name in stages if "cudabuild.engine.runner" in graph[name]]
    assert "cudabuild.engine.runner" not in graph["cudabuild.engine.context"]


def test_executors_are_handed_no_runner():
    """Executors execute; the runner alone restores, stores and stamps (cudabuild.engine.executors
    gets a Job and gives an outcome)."""
    path = PACKAGE / "engine" / "executors.py"
    tree = ast.parse(path.read_text())
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    assert "runner" not in named
    assert "cudabuild.engine.runner" not in import_graph()["cudabuild.engine.executors"]


def test_a_stage_reads_the_store_and_the_recipe_through_its_context():
    """A stage gets the recipe's form for its target (ctx.recipe) and its upstream outputs from its
    context, which verifies them and rebuilds a producer whose blob is bad: never from the store
    (ctx.store has gone) or the registry directly."""
    graph = import_graph()
    reaching = [f"{name} imports cudabuild.registry" for name in graph
                if name.startswith("cudabuild.backend") and "cudabuild.registry" in graph[name]]
    for name, path in module_files().items():
        if name.startswith("cudabuild.backend"):
            reaching += [f"{path.relative_to(REPO)}:{node.lineno} reads {ast.unparse(node)}"
                         for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.Attribute) and node.attr in ("store", "runner")
                         and isinstance(node.value, ast.Name) and node.value.id == "ctx"]
    assert not reaching, "; ".join(reaching)


def test_a_model_imports_nothing_of_the_backend():
    """cudabuild/models holds architectures and their weights; the ops a model's forward calls are
    registered by the stage that runs it (cudabuild.backend.custom_ops), never by the model."""
    graph = import_graph()
    reaching = [f"{name} imports {target}" for name in graph if name.startswith("cudabuild.models")
                for target in graph[name] if target.startswith("cudabuild.backend")]
    assert not reaching, "; ".join(reaching)

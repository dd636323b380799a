"""The package's layers: a module imports only from its own layer or the ones below.

0  errors, stats, state, index     pure Python: keys, segments, families' vocabulary, indexes
1  compute, kv                     the executor, RoPE, paged and master-mirror KV
2  recovery, coord, store          the mechanisms: recovery, future-use coordination, the store
3  engine, vllm, adapters          the two engines that run them (and adapters made with one)
4  workloads, serve, extras        callers of an engine; the check for optional dependencies
5  bench, demo, cli,               measurement and the command line; the reference pages
   reference_docs                  rendered from the command line and the models

A subpackage (kmesh/store/remote/) is in its top package's layer. And no kmesh modules import
each other in a circle.
"""

import ast
from pathlib import Path

import kmesh

LAYERS = {
    "errors": 0,
    "stats": 0,
    "state": 0,
    "index": 0,
    "compute": 1,
    "kv": 1,
    "recovery": 2,
    "coord": 2,
    "store": 2,
    "engine": 3,
    "vllm": 3,
    "adapters": 3,
    "workloads": 4,
    "serve": 4,
    "extras": 4,
    "bench": 5,
    "demo": 5,
    "cli": 5,
    "reference_docs": 5,
}
ROOT = Path(kmesh.__file__).parent


def _top(module: str) -> str:
    return module.split(".")[1]


def _imports(path: Path) -> set[str]:
    """The kmesh packages a module imports (lazy imports inside functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kmesh."):
            found.add(_top(node.module))
        elif isinstance(node, ast.Import):
            found.update(_top(a.name) for a in node.names if a.name.startswith("kmesh."))
    return found


def test_every_package_of_kmesh_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()}
    packages -= {"__init__", "__pycache__"}
    assert packages <= set(LAYERS), f"no layer for {sorted(packages - set(LAYERS))}"


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        own = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for other in _imports(path):
            if LAYERS[other] > LAYERS[own]:
                upward.append(f"{path.relative_to(ROOT)} imports kmesh.{other}")
    assert upward == []


def _module(path: Path) -> str:
    """The dotted name of a kmesh source file (a package's __init__.py: the package)."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The kmesh modules a module imports, TYPE_CHECKING and lazy imports included.

    `from kmesh.a import b` is kmesh.a.b when b is a module, else kmesh.a itself: a name a
    package re-exports is an import of the package's __init__, which imports its own modules in
    turn (so a module importing its own package, whose __init__ imports that module, is a
    circle). The parent packages Python initialises before a module are not counted: they are
    not an import the module makes.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kmesh."):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kmesh."))
    return found & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph, as the modules along it (the first again at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for other in sorted(graph[module]):
            if other in on_path:
                return [*path[path.index(other) :], other]
            if other not in done:
                found = visit(other)
                if found is not None:
                    return found
        path.pop()
        on_path.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found is not None:
                return found
    return None


def test_no_kmesh_modules_import_each_other_in_a_circle():
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {module: _module_imports(path, set(paths)) for module, path in paths.items()}
    graph = {module: imports - {module} for module, imports in graph.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_circle_finder_finds_a_circle_and_no_false_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None

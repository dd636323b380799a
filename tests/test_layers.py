"""The package's layers: a module imports only from its own layer or the ones below.

0  errors, stats, state, index     pure Python: keys, segments, families' vocabulary, indexes
1  compute, kv                     the executor, RoPE, paged and master-mirror KV
2  recovery, coord, store          the mechanisms: recovery, future-use coordination, the store
3  engine, vllm, adapters          the two engines that run them (and adapters made with one)
4  workloads, serve                callers of an engine
5  bench, demo, cli                measurement and the command line
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
    "bench": 5,
    "demo": 5,
    "cli": 5,
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

"""The package's import graph, read from the source: no module imports another that imports it back (TYPE_CHECKING
imports included), and eagle3_jax's sub-packages form the layers its docstring names, every import pointing down."""

import ast
import pathlib

import eagle3_jax

ROOT = pathlib.Path(eagle3_jax.__file__).parent
LAYERS = ["models", "parallel", "checkpoints", "decoding", "training", "serving", "demo"]  # bottom first


def imports() -> dict[str, set[str]]:
    """Each module of eagle3_jax -> the eagle3_jax names it imports (modules, and names from them)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("eagle3_jax",) + path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3_jax"):
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("eagle3_jax")}
        graph[name] = found
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = imports()
    mutual = sorted((a, b) for a in graph for b in graph[a] if b in graph and a in graph[b] and a < b)
    assert mutual == []


def test_sub_packages_import_only_the_layers_below_them():
    upward = []
    for module, names in imports().items():
        parts = module.split(".")
        if len(parts) < 3:
            continue  # eagle3_jax itself and its top-level modules sit above every layer
        for name in names:
            target = name.split(".")
            if len(target) > 1 and target[1] in LAYERS and target[1] != parts[1]:
                if LAYERS.index(target[1]) > LAYERS.index(parts[1]):
                    upward.append((module, name))
    assert upward == []


def test_the_layers_are_every_sub_package():
    assert sorted(LAYERS) == sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())

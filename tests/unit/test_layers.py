"""The package's layers (docs/architecture.md), read from its source: which layer may import which, hivemind only
in swarm/, nothing from experiments/, no module importing another's ``_private`` names, no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "p2p_diloco"
ALLOWED = {  # layer -> the layers its modules may import
    "core": {"core"},
    "observe": {"core", "observe"},
    "train": {"core", "train", "observe"},
    "swarm": {"core", "swarm"},
    "cli": {"core", "train", "observe", "swarm", "cli"},
}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _imports(tree: ast.Module, top_level_only: bool = False) -> list[tuple[str, list[str]]]:
    """(module, names) of every import; with ``top_level_only``, those that run when the module is imported
    (not inside a function or an ``if TYPE_CHECKING:`` block)."""
    nodes = list(ast.walk(tree))
    if top_level_only:
        nodes = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
        nodes += [inner for n in tree.body if isinstance(n, ast.Try) for inner in n.body]
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return found


def test_every_module_lives_in_a_layer():
    layers = {name.split(".")[1] for name in _modules() if name.count(".") >= 1}
    assert layers == set(ALLOWED)


def test_each_layer_imports_only_the_layers_below_it_and_hivemind_only_in_swarm():
    problems = []
    for name, tree in _modules().items():
        if name.count(".") < 1:
            continue
        layer = name.split(".")[1]
        for module, _ in _imports(tree):
            if module.split(".")[0] == "hivemind" and layer != "swarm":
                problems.append(f"{name} imports {module}")
            if module.split(".")[0] == "experiments":
                problems.append(f"{name} imports {module} (experiments stay out of the package)")
            if module.startswith("p2p_diloco.") and module.split(".")[1] not in ALLOWED[layer]:
                problems.append(f"{name} ({layer}) imports {module}")
    assert problems == []


def test_no_module_imports_another_modules_private_names():
    problems = [
        f"{name} imports {module}.{imported}"
        for name, tree in _modules().items()
        for module, names in _imports(tree)
        if module.startswith("p2p_diloco") and module != name
        for imported in names
        if imported.startswith("_")
    ]
    assert problems == []


def test_no_import_cycles():
    modules = _modules()
    graph = {
        name: {module for module, _ in _imports(tree, top_level_only=True) if module in modules and module != name}
        for name, tree in modules.items()
    }
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_checks_above_can_fail():
    tree = ast.parse("from hivemind import DHT\nfrom p2p_diloco.swarm.joining import _private\n")
    assert [module for module, _ in _imports(tree)] == ["hivemind", "p2p_diloco.swarm.joining"]
    assert _imports(tree)[1][1] == ["_private"]

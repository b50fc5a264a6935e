"""The package's import graph, read from the source (every import statement, the ones inside functions too):
no cycle among slime's modules, no import between the two training backends, and the subpackages layered one way.

A lazy import that dodges a cycle at import time is still a cycle here: the graph counts every `import` and
`from ... import` wherever it stands.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slime"

# Which top-level subpackage may import which (besides itself). utils is the floor; ray orchestrates them all.
ALLOWED = {
    "slime.utils": set(),
    "slime.config": {"slime.utils"},
    "slime.engine": {"slime.utils"},
    "slime.agent": {"slime.utils", "slime.engine"},
    "slime.rollout": {"slime.utils", "slime.config"},
    "slime.backends": {"slime.utils", "slime.config", "slime.engine"},
    "slime.ray": {"slime.utils", "slime.config", "slime.engine", "slime.rollout", "slime.backends", "slime.agent"},
}
BACKENDS = ("fsdp_utils", "megatron_utils")
# slime's public path of the parser, kept for its plugins and scripts: a re-export of slime.config.arguments.
PUBLIC_SHIMS = {("slime.utils.arguments", "slime.config.arguments")}


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the slime modules it imports (a `from pkg import name` of a submodule counts as that module)."""
    modules = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = collections.defaultdict(set)
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                resolved = resolve(target) if target.startswith("slime") else None
                # a module's own ancestors are imported before it anyway: not an edge of its own
                if resolved and resolved != module and not module.startswith(resolved + "."):
                    graph[module].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def top_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_lazy_imports_included():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def backend_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "backends" and parts[2] in BACKENDS else None


def test_the_backends_are_peers():
    graph = import_graph()
    crossing = [(a, b) for a, targets in graph.items() for b in targets
                if backend_of(a) and backend_of(b) and backend_of(a) != backend_of(b)]
    assert crossing == []
    assert {backend_of(m) for m in graph} >= set(BACKENDS)  # both are there to check


def test_subpackages_import_one_way():
    graph = import_graph()
    wrong = sorted((a, b) for a, targets in graph.items() for b in targets
                   if top_package(a) != top_package(b) and top_package(a) in ALLOWED
                   and top_package(b) not in ALLOWED[top_package(a)] and (a, b) not in PUBLIC_SHIMS)
    assert wrong == []


def test_every_top_level_subpackage_has_a_layer():
    assert {top_package(m) for m in module_files() if m.count(".") >= 1} <= set(ALLOWED)

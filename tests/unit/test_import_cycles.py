"""No import cycles among cloverq's modules (issue 30): the layering contracts in pyproject.toml
(`lint-imports`) forbid imports across layers; this checks that no module reaches itself again
through imports at all, within a layer included. grimp (import-linter's graph) reads every import
statement, at module level, in functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import grimp

PACKAGES = ("api", "scheduler", "worker", "cli", "client")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    modules = graph.modules
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_sees_a_cycle() -> None:
    graph = grimp.ImportGraph()  # a -> b -> c -> a, and d -> a outside the cycle
    for importer, imported in (("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")):
        graph.add_import(importer=importer, imported=imported)
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_in_the_product() -> None:
    graph = grimp.build_graph(*PACKAGES)
    assert len(graph.modules) > 200  # the product was read, not an empty tree
    assert _cycles(graph) == []

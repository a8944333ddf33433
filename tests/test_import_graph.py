"""The import graph flows one way (docs/CONTRACTS.md, "Packages and the import graph"):

    schemas, cbuild <- transport <- indexer <- router_api (the service) <- router <- cli
                                 <- producer <- sim

Every import in the shipped packages is read with `ast` (function-level and TYPE_CHECKING imports
included): a package may import only the layers below it, never one beside or above it, and the
packages form no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What each package may import (besides itself and third-party code). `sim` is a leaf over the producer
# and may use the service's tokenizer; the router drives simulated workers in its demo.
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "cbuild": set(),
    "transport": {"schemas"},
    "indexer": {"schemas", "cbuild", "transport"},
    "producer": {"schemas", "cbuild", "transport"},
    "router_api": {"schemas", "cbuild", "transport", "indexer"},
    "sim": {"schemas", "cbuild", "transport", "producer", "indexer", "router_api"},
    "router": {"schemas", "cbuild", "transport", "indexer", "router_api", "producer", "sim"},
    "cli": {"schemas", "cbuild", "transport", "indexer", "router_api", "producer", "sim", "router"},
}
def layer(module: str) -> str:
    return module.split(".")[0]


def imports(path: Path) -> set[str]:
    """Every absolute module name `path` imports; relative imports stay inside their package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[tuple[str, str], set[str]]:
    """(importing module, imported layer) -> the names it imports from that layer."""
    edges: dict[tuple[str, str], set[str]] = {}
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).glob("**/*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for name in imports(path):
                if name.split(".")[0] not in ALLOWED:
                    continue
                target = layer(name)
                if target != layer(module):
                    edges.setdefault((module, target), set()).add(name)
    return edges


def test_every_package_imports_only_the_layers_below_it():
    wrong = {f"{module} -> {sorted(names)}" for (module, target), names in graph().items()
             if target not in ALLOWED[layer(module)]}
    assert not wrong, "imports against the one-way flow:\n" + "\n".join(sorted(wrong))


def test_no_cycle_between_packages():
    deps: dict[str, set[str]] = {pkg: set() for pkg in ALLOWED}
    for module, target in graph():
        deps[layer(module)].add(target)
    done: set[str] = set()

    def visit(pkg: str, path: tuple[str, ...]) -> None:
        assert pkg not in path, "package cycle: " + " -> ".join((*path, pkg))
        if pkg not in done:
            for dep in deps[pkg]:
                visit(dep, (*path, pkg))
            done.add(pkg)

    for pkg in deps:
        visit(pkg, ())


def test_the_rules_table_is_itself_one_way():
    """ALLOWED must be a DAG, or the first test would accept a cycle spread over two edits."""
    order = ["schemas", "cbuild", "transport", "indexer", "producer", "router_api", "sim", "router", "cli"]
    for pkg, below in ALLOWED.items():
        assert all(order.index(dep) < order.index(pkg) for dep in below), pkg


@pytest.mark.skipif(not (ROOT / "router" / "proxy").is_dir(), reason="the proxy is still in router_api/")
def test_the_proxy_never_imports_the_simulator():
    bad = sorted(f"{m} -> {sorted(n)}" for (m, t), n in graph().items() if m.startswith("router.proxy") and t == "sim")
    assert not bad, bad


def test_the_service_packages_never_import_torch():
    heavy = {"torch"}
    bad = sorted(str(p.relative_to(ROOT)) for pkg in ("schemas", "cbuild", "transport", "indexer", "router_api")
                 for p in (ROOT / pkg).glob("**/*.py") if {n.split(".")[0] for n in imports(p)} & heavy)
    assert not bad, bad

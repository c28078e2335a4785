"""Check the shape of tapllm's import graph: no circles, no upward imports, a leaf ``tapllm.tap``.

Every ``import`` of a tapllm module counts, wherever it is written: at module level, inside a
function (lazy), or under ``if TYPE_CHECKING`` (type-only). Rules:

- no circle: no module reaches itself through imports of any kind;
- every package in one layer: :data:`LAYERS` lists each package (or top-level module) once, none
  inside another, and every module of tapllm falls in one of them (or in :data:`TOP`);
- no upward import: a module imports only from its own layer or lower ones (:data:`LAYERS`);
- ``tapllm.tap`` is a leaf: it imports nothing else of tapllm.

Run ``python scripts/import_graph.py`` (exit status 1 and the violations when a rule breaks;
``--edges`` prints the graph); ``tests/test_import_graph.py`` runs the same check.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tapllm"

# Lowest first: each package (or top-level module) in exactly one layer; a module belongs to the
# layer of its package. Only the package itself (``tapllm``) and ``tapllm.__main__`` sit above.
LAYERS: list[tuple[str, ...]] = [
    ("tapllm.tap", "tapllm.utils"),
    ("tapllm.kernels", "tapllm.backends", "tapllm.quant", "tapllm.layers"),
    ("tapllm.config",),
    ("tapllm.models", "tapllm.loader", "tapllm.sae"),
    ("tapllm.outputs", "tapllm.hidden_states", "tapllm.steering", "tapllm.structured", "tapllm.parallel"),
    ("tapllm.sampling_params",),
    ("tapllm.engine",),
    ("tapllm.llm", "tapllm.server", "tapllm.collect", "tapllm.datasets", "tapllm.client"),
    ("tapllm.serving", "tapllm.cli"),
]
TOP = ("tapllm", "tapllm.__main__")
LEAVES = ("tapllm.tap",)


@dataclass(frozen=True, slots=True)
class Edge:
    """``source`` imports ``target`` at line ``line``; ``kind`` is "run" or "type" (under TYPE_CHECKING)."""

    source: str
    target: str
    line: int
    kind: str


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of the module in ``path`` under the package folder ``root``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, name: str, is_package: bool) -> list[tuple[str, list[str], int, bool]]:
    """(module, names imported from it, line, type-only) for every import statement in ``tree``."""
    found: list[tuple[str, list[str], int, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, type_only)
                continue
            visit_stmt(child, type_only)

    def visit_stmt(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            found.append((base, [a.name for a in node.names], node.lineno, type_only))
        visit(node, type_only)

    visit(tree, False)
    return found


def build_graph(root: Path = ROOT) -> tuple[set[str], list[Edge]]:
    """The package's modules and the import edges between them."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    edges = []
    for f in files:
        name = module_name(f, root)
        tree = ast.parse(f.read_text(), str(f))
        for base, names, line, type_only in _imports(tree, name, f.name == "__init__.py"):
            if base != "tapllm" and not base.startswith("tapllm."):
                continue
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules] or [base]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target != name:
                    edges.append(Edge(name, target, line, "type" if type_only else "run"))
    return modules, edges


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer in :data:`LAYERS` (its package's; ``len(LAYERS)`` for :data:`TOP`;
    None: in no layer)."""
    if module in TOP:
        return len(LAYERS)
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def layer_errors() -> list[str]:
    """What is wrong with :data:`LAYERS` itself: a name listed twice, or inside another listed package."""
    listed = [p for layer in LAYERS for p in layer]
    out = [f"layers: {p} is listed twice" for p in sorted({p for p in listed if listed.count(p) > 1})]
    out += [f"layers: {p} lies inside {q}, whose modules share its layer" for p in listed for q in listed
            if p.startswith(q + ".")]
    return out


def circles(modules: set[str], edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(modules)))
    for m in sorted(modules):
        if m not in index:
            connect(m)
    return found


def violations(root: Path = ROOT) -> list[str]:
    """Every broken rule, one line each (empty: the graph is in shape)."""
    modules, edges = build_graph(root)
    out = [f"circle: {' <-> '.join(c)}" for c in circles(modules, edges)] + layer_errors()
    out += [f"unplaced: {m} is in no layer of LAYERS" for m in sorted(modules) if layer_of(m) is None]
    for e in edges:
        source, target = layer_of(e.source), layer_of(e.target)
        if source is not None and target is not None and target > source:
            out.append(f"upward ({e.kind}): {e.source}:{e.line} imports {e.target}")
        leaf = next((p for p in LEAVES if e.source == p or e.source.startswith(p + ".")), None)
        if leaf and not (e.target == leaf or e.target.startswith(leaf + ".")):
            out.append(f"leaf: {e.source}:{e.line} imports {e.target} ({leaf} must import nothing else of tapllm)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every import edge")
    args = parser.parse_args()
    if args.edges:
        for e in build_graph()[1]:
            print(f"{e.source} -> {e.target} ({e.kind}, line {e.line})")
    found = violations()
    for line in found:
        print(line)
    modules, edges = build_graph()
    print(f"{len(modules)} modules, {len(edges)} imports: "
          + ("no circle, no upward import, tapllm.tap a leaf" if not found else f"{len(found)} violations"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""The shape of the product code: no import circle between its modules, and no module of the two
tiers over 500 lines (a module that grows past it holds more than one job).

Imports are read from the source (``ast``), at module level and inside functions alike; those
under ``if TYPE_CHECKING:`` are left out (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("duplex", "session_service", "worker_service", "realtime_service")
MAX_LINES = 500
#: Where the line bound holds: the two tiers (the issue that set it) and the edge.
BOUNDED = ("session_service", "worker_service", "realtime_service")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            if "v1" in path.relative_to(REPO).parts:  # generated protobuf code
                continue
            found[_module_name(path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            targets = []
        for target in targets:
            # The deepest known module the import names (a name imported from a module is not one).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def test_no_import_circle_in_the_product_code() -> None:
    modules = _modules()
    known = set(modules)
    # A package's __init__ imported for a submodule is not an edge to the package's own modules.
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_checker_sees_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_the_tiers_over_500_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for name, path in _modules().items()
        if name.split(".")[0] in BOUNDED
        and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"

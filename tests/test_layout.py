"""The package's layout: no module imports one that imports it back, directly or through others, counting the imports
inside functions too (imports under `if TYPE_CHECKING:` excepted: they never run)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "rbee_worker"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The package's modules that this module's code imports, wherever the import statement is."""
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return found & modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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


def test_the_package_has_no_import_cycles() -> None:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {name: imported(ast.parse(path.read_text()), modules) - {name} for name, path in files.items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk finds the package and its imports
    assert cycles(graph) == []


def test_a_cycle_through_a_function_level_import_is_found() -> None:
    tree = ast.parse("import os\ndef f():\n    from pkg.b import g\nif TYPE_CHECKING:\n    import pkg.c\n")
    assert imported(tree, {"pkg.b", "pkg.c", "pkg.b.g"}) == {"pkg.b", "pkg.b.g"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_module_names_are_unique() -> None:
    """A module's file name names one module in the package, and one test module in tests/ (pytest imports the test
    modules, and they import one another, by that name alone)."""
    for root, pattern in ((PACKAGE, "*.py"), (PACKAGE.parent.parent / "tests", "test_*.py")):
        names = [path.name for path in root.rglob(pattern) if path.name != "__init__.py"]
        assert len(names) > 60
        assert sorted(name for name in set(names) if names.count(name) > 1) == []


def test_no_engine_module_holds_more_than_400_lines() -> None:
    """A module of the engine past about 400 lines usually holds two jobs: it is split where they part."""
    lengths = {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in PACKAGE.glob("engine/**/*.py")
    }
    assert len(lengths) > 30
    assert {name: lines for name, lines in lengths.items() if lines > 400} == {}

"""The layout is the architecture (docs/development.md, "The rooms"): each room of clef_cuda imports only the rooms
ROOMS lets it, no module is part of an import circle, and functions stay short enough to read. Checked on every import
statement, function-level ones included; imports under `if TYPE_CHECKING:` (annotations only) are not imports."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clef_cuda"

# room -> the rooms it may import. A room is a sub-package (clef_cuda/kernels/) or a top-level module
# (clef_cuda/decider.py); `import clef_cuda` alone (the version) is open to all, `clef_cuda._C` belongs to kernels.
ROOMS: dict[str, set[str]] = {
    "errors": set(),
    "kernels": set(),
    "request": {"errors"},
    "runtime": {"errors"},
    "model": {"errors", "kernels", "request"},
    "decider": {"errors", "kernels", "request", "model"},
    "compare": {"errors", "request", "decider"},
    "verification": {"errors", "kernels", "request", "runtime", "model", "decider"},
    "tuning": {"errors", "kernels", "request", "runtime", "model", "verification"},
    "parallel": {"errors", "kernels", "request", "runtime", "model", "verification", "tuning"},
    "serving": {"errors", "kernels", "request", "runtime", "model", "decider", "verification"},
    "lifecycle": {"errors", "kernels", "request", "runtime", "model", "verification", "tuning", "parallel"},
    "__init__": {"kernels", "decider"},  # the package's face: the version, build_info, Decider (lazily)
}

# The longest a function may be, in lines (its decorators and docstring included): app/ maps HTTP onto the lifecycle
# and the engine, clef_cuda/ holds the work. A longer one is split where it does two things.
LONGEST_FUNCTION = {"app": 120, "clef_cuda": 150}


def test_the_developers_guide_states_the_same_rooms():
    """docs/development.md's table of rooms is what a newcomer reads: it says what ROOMS says."""
    text = (ROOT / "docs" / "development.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)(?:/|\.py)` \| .* \| ([a-z, ]+) \|$", text, re.M)
    documented = {room: set() if allowed == "nothing" else set(allowed.split(", ")) for room, allowed in rows}
    assert documented == ROOMS


def annotation_only(tree: ast.Module) -> set[int]:
    """The ids of nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped |= {id(inner) for inner in ast.walk(node)}
    return skipped


def imported_modules(path: Path, module: str | None = None) -> set[str]:
    """Every module `path` imports: `from a.b import c` gives a.b and a.b.c (c may be a module); a relative
    import is resolved against the package of `path` (or of `module`, its dotted name): `from ..kernels import
    ops` in clef_cuda/serving/x.py gives clef_cuda.kernels and clef_cuda.kernels.ops."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = annotation_only(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = []
            if node.level:  # the package `path` is in (itself for an __init__.py), then up a level a dot
                package = (module or module_name(path)).split(".")[: None if path.name == "__init__.py" else -1]
                base = package[: len(package) - node.level + 1]
            imported = ".".join(base + ([node.module] if node.module else []))
            if imported:
                names.add(imported)
                names |= {f"{imported}.{alias.name}" for alias in node.names}
    return names


# Names the package's face exports, by the room they come from.
FACE = {"_C": "kernels", "build_info": "kernels", "Decider": "decider", "__version__": None}


def room_of(module: str) -> str | None:
    """The room of an imported clef_cuda module; None for the package itself and for anything not ours."""
    parts = module.split(".")
    if parts[0] != "clef_cuda" or len(parts) == 1:
        return None
    return FACE.get(parts[1], parts[1])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_room_is_listed_and_the_rules_have_no_circle():
    on_disk = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in package_files()}
    assert on_disk == set(ROOMS), "a new room needs its line in ROOMS and in docs/development.md"
    order: list[str] = []
    while len(order) < len(ROOMS):  # a topological order exists only without a circle
        ready = sorted(r for r in ROOMS if r not in order and ROOMS[r] <= set(order))
        assert ready, f"the rooms {sorted(set(ROOMS) - set(order))} import each other"
        order += ready


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_imports_only_the_rooms_below_it(room):
    files = [p for p in package_files() if (p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0]) == room]
    for path in files:
        imported = imported_modules(path)
        assert not {m for m in imported if m == "app" or m.startswith("app.")}, f"{path} imports the HTTP app"
        bad = {m for m in imported if (r := room_of(m)) is not None and r != room and r not in ROOMS[room]}
        assert not bad, (
            f"{path.relative_to(ROOT)} ({room}) imports {sorted(bad)}; {room} may import {sorted(ROOMS[room])}"
        )


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (clef_cuda and app)."""
    paths = [*package_files(), *sorted((ROOT / "app").rglob("*.py"))]
    modules = {module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        imported = imported_modules(path)
        graph[name] = {m for m in imported if m in modules and m != name and m not in ("clef_cuda", "app")}
    return graph


def circles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """One circle through each strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> Iterator[list[str]]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                yield from visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                yield sorted(members)

    for node in sorted(graph):
        if node not in index:
            yield from visit(node)


def test_no_module_is_part_of_an_import_circle():
    found = list(circles(import_graph()))
    assert not found, f"modules that import each other (directly or around a circle): {found}"


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert list(circles(graph)) == [["a", "b", "c"]]


def test_the_check_sees_function_level_imports_and_skips_annotation_only_ones(tmp_path):
    source = tmp_path / "late.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from clef_cuda.serving.engine import Engine\n"
        "def f():\n    from clef_cuda.serving.cache import PrefixCache\n"
    )
    imported = imported_modules(source)
    assert "clef_cuda.serving.cache" in imported and "clef_cuda.serving.engine" not in imported
    relative = tmp_path / "probe.py"
    relative.write_text("from ..serving import plan\nfrom . import ops\n")
    imported = imported_modules(relative, "clef_cuda.kernels.probe")
    assert {"clef_cuda.serving.plan", "clef_cuda.kernels.ops"} <= imported, imported


def long_functions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines > {limit})")
    return found


@pytest.mark.parametrize("tree", sorted(LONGEST_FUNCTION))
def test_functions_are_short_enough_to_read(tree):
    found = [f for path in sorted((ROOT / tree).rglob("*.py")) for f in long_functions(path, LONGEST_FUNCTION[tree])]
    assert not found, found

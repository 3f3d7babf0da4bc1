"""The layout shows the architecture: clef_cuda.model (what a release is) never imports clef_cuda.serving
or the app; clef_cuda.request (what a request becomes) imports neither the model's trunk nor serving nor
the app; the in-process Decider stands on model and request alone. Checked on every import statement,
function-level ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "clef_cuda"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


FORBIDDEN = {
    "model": ("clef_cuda.serving", "app"),
    "request": ("clef_cuda.serving", "clef_cuda.model.trunk", "clef_cuda.model.trunk_cache", "app"),
}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_never_imports_the_ones_above_it(layer):
    for path in sorted((PACKAGE / layer).glob("*.py")):
        bad = {
            m
            for m in imported_modules(path)
            for prefix in FORBIDDEN[layer]
            if m == prefix or m.startswith(prefix + ".")
        }
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


def test_the_decider_stands_on_model_and_request():
    bad = {m for m in imported_modules(PACKAGE / "decider.py") if m.startswith(("clef_cuda.serving", "app"))}
    assert not bad, bad


def test_the_check_sees_function_level_imports(tmp_path):
    source = tmp_path / "late.py"
    source.write_text("def f():\n    from clef_cuda.serving.cache import PrefixCache\n")
    assert "clef_cuda.serving.cache" in imported_modules(source)

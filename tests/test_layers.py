"""The package's layers point one way: core <- quant <- tools <- tui; and core stays readable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"core": 0, "quant": 1, "tools": 2, "server": 3, "tui": 4}
MAX_CORE_FUNCTION_LINES = 40


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Every pagechat module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("pagechat.")}


def _upward(folder: str) -> list[str]:
    level = LAYERS[folder]
    bad = []
    for path in _modules(folder):
        for name in sorted(_imported(path)):
            layer = name.split(".")[1]
            if LAYERS.get(layer, len(LAYERS)) > level:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_imports_point_down(folder):
    assert _upward(folder) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text("def f():\n    from pagechat.tui.app import App\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _upward("core") == ["core/x.py imports pagechat.tui.app"]


def test_core_functions_are_short():
    long = []
    for path in _modules("core"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CORE_FUNCTION_LINES:
                    long.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
                    )
    assert long == []

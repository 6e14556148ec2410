"""The package's layers point one way: core <- quant <- tools <- server, tui <- cli (the server and
the app apart from each other, the command line on top); no module imports another that imports
it back, however far round; and core stays readable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"core": 0, "quant": 1, "tools": 2, "server": 3, "tui": 3, "cli": 4}
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
    """Imports of a package above it, or beside it (the server and the app)."""
    level = LAYERS[folder]
    bad = []
    for path in _modules(folder):
        for name in sorted(_imported(path)):
            layer = name.split(".")[1]
            if layer != folder and LAYERS.get(layer, len(LAYERS)) >= level:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("pagechat", *parts[: -1 if parts[-1] == "__init__" else None]))


def _graph() -> dict[str, set[str]]:
    """module -> the pagechat modules it imports (`from pagechat.a import b`, where b is a module,
    counts as importing pagechat.a.b)."""
    paths = [p for folder in LAYERS for p in _modules(folder)]
    known = {_module(p) for p in paths}
    graph = {}
    for path in paths:
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagechat."):
                names = {f"{node.module}.{a.name}" for a in node.names}
                edges |= (names & known) or {node.module}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("pagechat.")}
        graph[_module(path)] = (edges & known) - {_module(path)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself, with the way round (depth-first, each reported once)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_imports_point_down(folder):
    assert _upward(folder) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text("def f():\n    from pagechat.tui.app import App\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _upward("core") == ["core/x.py imports pagechat.tui.app"]


def test_no_module_imports_itself_round_a_cycle():
    assert _cycles(_graph()) == []


def test_the_check_sees_a_cycle():
    graph = {"pagechat.tui.a": {"pagechat.tui.b"}, "pagechat.tui.b": {"pagechat.tui.a"}}
    assert _cycles(graph) == [["pagechat.tui.a", "pagechat.tui.b", "pagechat.tui.a"]]


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


DRIVING = {"add", "encode", "encode_chat", "abort", "release", "update_params"}  # requests' API


def _engine_reads(folder: str) -> list[str]:
    """Where a module outside core reads the engine's insides: its scheduler or block manager,
    or sequences out of its request table; the server and the app do not touch the table at all
    (their loop drives it), the rest may only call the request layer's own methods."""
    bad = []
    for path in _modules(folder):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name not in ("engine", "eng") or node.attr not in (
                "requests",
                "scheduler",
                "blocks",
            ):
                continue
            up = parents.get(node)
            calls = isinstance(up, ast.Attribute) and up.attr in DRIVING
            if node.attr != "requests" or folder in ("server", "tui") or not calls:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads engine.{node.attr}")
    return bad


@pytest.mark.parametrize("folder", [f for f in sorted(LAYERS) if f != "core"])
def test_front_ends_read_records_not_the_engines_insides(folder):
    assert _engine_reads(folder) == []


def test_the_check_sees_a_read_of_the_engines_insides(tmp_path, monkeypatch):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "x.py").write_text(
        "def f(engine):\n    engine.requests.add([1])\n    return engine.requests[0]\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _engine_reads("cli") == ["cli/x.py:3 reads engine.requests"]

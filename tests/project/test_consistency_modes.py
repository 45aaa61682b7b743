"""One type per consistency mode, asked by capability (issue 41, item 1).

A mode is a :class:`kvstore.modes.ConsistencyMode`, the same object on the worker
and the server; code asks it what the mode allows (``mode.write_in``,
``mode.rounds``, ...). This test walks the AST of every module of ``kvstore`` and
fails where a mode is tested by what it is instead: a comparison with a mode's
name (``mode == "sync"``, ``name in ("ssp", "async")``), with a mode object or a
strategy class (``mode is SYNC``, ``type(s) is Sync``), or an ``isinstance`` /
``issubclass`` test of one (``isinstance(strategy, Ssp)``). Only the
definitions may name them so: kvstore/modes.py, and server/modes.py's table.
It also holds the layering that makes the shared type possible: the server never
imports the worker, and kvstore/modes.py imports neither.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from kvstore import modes as shared
from kvstore.modes import ConsistencyMode
from kvstore.server.consistency import Consistency
from kvstore.server.modes import MODES

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFINITIONS = {ROOT / "kvstore" / "modes.py", ROOT / "kvstore" / "server" / "modes.py"}

MODE_NAMES = set(MODES)                                          # "sync", "async", "ssp"
MODE_OBJECTS = {name for name, value in vars(shared).items() if isinstance(value, ConsistencyMode)}
STRATEGIES = {cls.__name__ for cls in MODES.values()} | {"Consistency", "ConsistencyMode"}


def _names(node: ast.AST) -> set[str]:
    """The names an expression refers to directly: ``x``, ``a.x``, and those of a
    tuple/list/set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    return set()


def mode_tests(source: str, filename: str = "<source>") -> list[str]:
    """Every test of a consistency mode by its name, object or class in ``source``:
    ``"line: code"`` each."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        hit = False
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hit = any(_strings(o) & MODE_NAMES or _names(o) & (MODE_OBJECTS | STRATEGIES) for o in operands)
            # (a call such as type(s) compared with a class is caught by its class's name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            hit = bool(_names(node.args[1]) & (STRATEGIES | MODE_OBJECTS))
        elif isinstance(node, ast.MatchValue):       # case "sync":
            hit = bool(_strings(node.value) & MODE_NAMES)
        if hit:
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def modules():
    return sorted(p for p in (ROOT / "kvstore").rglob("*.py") if p not in DEFINITIONS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_tests_which_consistency_mode_it_is(path):
    found = mode_tests(path.read_text(), str(path))
    assert not found, (f"{path.relative_to(ROOT)} tests a consistency mode by what it is; ask its "
                       f"ConsistencyMode (kvstore/modes.py) for the capability instead: {found}")


@pytest.mark.parametrize("snippet", [
    'if self._mode == "sync": pass',
    'ok = "ssp" != mode.name',
    'ok = name in ("async", "ssp")',
    'ok = mode is SYNC',
    'ok = type(strategy) is Sync',
    'ok = isinstance(self.consistency, Sync)',
    'ok = isinstance(s, (Async, Ssp))',
    'ok = issubclass(cls, Consistency)',
    'match mode.name:\n    case "sync":\n        pass',
])
def test_the_check_catches_each_kind_of_mode_test(snippet):
    assert mode_tests(snippet), snippet


@pytest.mark.parametrize("snippet", [
    'ok = self._mode.write_in and group is None',
    'strategy = MODES.get(mode)',
    'ok = kind == "dist_async" or bound == math.inf',     # a store type, not a mode
    'ok = op == ops.PUSHPULL',
    'ok = isinstance(entry, HeldPush)',
])
def test_the_check_leaves_capability_questions_alone(snippet):
    assert not mode_tests(snippet), snippet


def test_every_mode_is_one_shared_object_run_by_one_strategy():
    """MODES maps each name to the strategy whose mode has that name, and every
    ConsistencyMode in kvstore/modes.py has its strategy."""
    assert {name: cls.mode.name for name, cls in MODES.items()} == {name: name for name in MODES}
    assert all(issubclass(cls, Consistency) for cls in MODES.values())
    assert {getattr(shared, name) for name in MODE_OBJECTS} == {cls.mode for cls in MODES.values()}


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "kvstore" / "server").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_never_imports_the_worker(path):
    assert not {m for m in _imports(path) if m.startswith("kvstore.worker")}


def test_the_shared_modes_import_only_the_standard_library():
    assert {m.split(".")[0] for m in _imports(ROOT / "kvstore" / "modes.py")} <= {"__future__", "dataclasses"}


@pytest.mark.parametrize("path", [ROOT / "kvstore" / "modes.py"] + [
    ROOT / "kvstore" / "server" / f"{name}.py"
    for name in ("consistency", "modes", "sync", "write_in", "asyncmode", "ssp", "chunks", "members",
                 "requests", "rounds", "tables", "dyntables")], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_modes_and_their_strategies_are_pure(path):
    """No sockets, threads or clocks (test_layering.py's rule, over these files too)."""
    forbidden = {"zmq", "socket", "threading", "time", "subprocess", "pickle", "tracker"}
    assert not {m for m in _imports(path) if m.split(".")[0] in forbidden}

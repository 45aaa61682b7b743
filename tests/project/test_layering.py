"""Imports only go down: tracker never imports kvstore; the pure layers import no
sockets, threads or clocks (checked from the source, not by running it)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files(*parts):
    base = ROOT.joinpath(*parts)
    return sorted(base.rglob("*.py")) if base.is_dir() else [base]


@pytest.mark.parametrize("path", files("tracker"), ids=lambda p: str(p.relative_to(ROOT)))
def test_tracker_never_imports_kvstore(path):
    assert not {m for m in imported_modules(path) if m.split(".")[0] == "kvstore"}


LAUNCHERS = {p.stem for p in files("tracker") if p.parent.name == "tracker"} - {"__init__"}


def relative_imports(path: pathlib.Path) -> set[str]:
    """Modules named by ``from .x import`` / ``from . import x`` / ``from .. import x``,
    as their last component (enough here: tracker's module names are unique)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module:
                names.add(node.module.split(".")[0] if node.level == 1 else node.module.split(".")[-1])
            names |= {alias.name for alias in node.names}
    return names


@pytest.mark.parametrize("path", files("tracker", "control"), ids=lambda p: str(p.relative_to(ROOT)))
def test_control_plane_never_imports_a_launcher(path):
    """tracker/control is the layer every node runs; the launchers sit above it."""
    absolute = {m for m in imported_modules(path) if m.startswith("tracker.") and not m.startswith("tracker.control")}
    assert not absolute and not (relative_imports(path) & LAUNCHERS)


PURE = files("kvstore", "protocol") + files("kvstore", "sharding.py") + files("kvstore", "compression.py") + \
    files("kvstore", "server", "state.py") + files("kvstore", "server", "rounds.py") + \
    files("kvstore", "server", "writein.py") + files("kvstore", "optimizer") + \
    files("kvstore", "server", "optimizer_slot.py") + files("kvstore", "server", "snapshot.py") + \
    files("kvstore", "server", "stalls.py") + files("kvstore", "registry.py") + \
    files("kvstore", "server", "tables.py") + files("kvstore", "server", "staleness.py") + \
    files("kvstore", "rows", "layout.py") + files("kvstore", "rows", "rowinit.py") + \
    files("kvstore", "rows", "dynamic.py") + files("kvstore", "rows", "dyntable.py") + files("kvstore", "server", "dyntables.py") + \
    files("tracker", "control", "scheduler_state.py") + files("tracker", "control", "records.py")


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_layers_have_no_io(path):
    forbidden = {"zmq", "socket", "threading", "time", "subprocess", "pickle", "tracker"}
    assert not {m for m in imported_modules(path) if m.split(".")[0] in forbidden}


@pytest.mark.parametrize("path", files("kvstore") + files("tracker"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_anywhere(path):
    assert not {m for m in imported_modules(path) if m.split(".")[0] in {"pickle", "cloudpickle", "dill"}}
    assert "shell=True" not in path.read_text()

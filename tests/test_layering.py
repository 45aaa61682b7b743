"""Imports only go down: tracker never imports kvstore; the pure layers import no
sockets, threads or clocks (checked from the source, not by running it)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


PURE = files("kvstore", "protocol") + files("kvstore", "sharding.py") + files("kvstore", "compression.py") + \
    files("kvstore", "server", "state.py") + files("kvstore", "server", "rounds.py") + \
    files("kvstore", "server", "writein.py") + files("kvstore", "optimizer")


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_layers_have_no_io(path):
    forbidden = {"zmq", "socket", "threading", "time", "subprocess", "pickle", "tracker"}
    assert not {m for m in imported_modules(path) if m.split(".")[0] in forbidden}


@pytest.mark.parametrize("path", files("kvstore") + files("tracker"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_anywhere(path):
    assert not {m for m in imported_modules(path) if m.split(".")[0] in {"pickle", "cloudpickle", "dill"}}
    assert "shell=True" not in path.read_text()

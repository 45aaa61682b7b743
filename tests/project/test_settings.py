"""One source of configuration: the table of tracker/control/env.py.

Its documentation (docs/configuration.md shows ``markdown_table()`` as it is), the
typed objects built from it (``Settings``, ``kvstore.Config``) and every use in
kvstore/ and tracker/ agree with it: each ``KVSTORE_*`` name used there is in the
table, and no default or list of choices of the table is written out again
where code uses it as one (read from the source, not by running it)."""

from __future__ import annotations

import ast
import dataclasses
import operator
import pathlib
import re

import pytest

from kvstore.config import Config
from tracker.control import env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "kvstore").rglob("*.py")) + sorted((ROOT / "tracker").rglob("*.py"))
DEFAULTS = {var.field: var.default for var in env.VARIABLES}
CHOICES = {var.name: frozenset(var.parse.choices) for var in env.VARIABLES
           if hasattr(var.parse, "choices")}
_OPS = {ast.LShift: operator.lshift, ast.Mult: operator.mul, ast.Add: operator.add,
        ast.Sub: operator.sub, ast.Pow: operator.pow}


def _ids(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def documented_table() -> str:
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index("| variable | MXNet alias | default | meaning |")
    return text[start:text.index("\n\n", start)]


def test_the_documented_table_is_the_generated_one():
    assert documented_table() == env.markdown_table(), (
        "docs/configuration.md differs from tracker/control/env.py: paste the output of "
        "python -c \"import tracker.control.env as e; print(e.markdown_table())\"")


def test_settings_and_config_have_one_field_per_variable_with_its_default():
    settings = {f.name: f.default for f in dataclasses.fields(env.Settings)}
    assert settings == DEFAULTS
    config = {f.name: f.default for f in dataclasses.fields(Config)}
    assert set(config) - set(settings) == {"write_in_bytes", "exit_on_abort"}
    assert {name: config[name] for name in settings} == DEFAULTS
    assert env.read({}) == env.Settings() and Config.from_env({}) == Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.Settings().timeout = 1.0


def test_read_gives_typed_settings():
    s = env.read({"KVSTORE_TIMEOUT": "7", "DMLC_NUM_WORKER": "3", "KVSTORE_SERVER_GPUS": "0,1",
                  "KVSTORE_SECURE": "yes", "KVSTORE_TRANSPORT": "TCP"})
    assert (s.timeout, s.num_workers, s.server_gpus, s.secure, s.transport) == (7.0, 3, (0, 1), True, "tcp")
    assert isinstance(s.timeout, float) and env.default("KVSTORE_TIMEOUT") == 300.0
    assert "abc" not in repr(env.read({"KVSTORE_SECRET": "abc"}))   # the secret is never shown


@pytest.mark.parametrize("path", SOURCES, ids=_ids)
def test_every_variable_used_is_in_the_table(path):
    used = set(re.findall(r"\b(?:KVSTORE|DMLC)_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    known = {name for var in env.VARIABLES for name in (var.name, *var.aliases)}
    assert used <= known, f"not in tracker/control/env.py: {sorted(used - known)}"


def _literal(node):
    """The value of a literal (``300.0``, ``"auto"``, ``2 << 20``, a tuple of them),
    or raise ValueError."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_literal(node.left), _literal(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return tuple(_literal(e) for e in node.elts)
    raise ValueError("not a literal")


def _copies(node, default) -> bool:
    """``node`` is a literal equal to ``default`` (``True`` is no copy of ``1``)."""
    try:
        value = _literal(node)
    except (ValueError, TypeError):
        return False
    return type(value) is type(default) and value == default


def _env_get(node) -> str | None:
    """The variable of ``environ.get("KVSTORE_X"...)``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in env.BY_NAME):
        return node.args[0].value
    return None


def copied_defaults(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            found += [f"line {d.lineno}: parameter {a.arg}={ast.unparse(d)}" for a, d in pairs
                      if a.arg in DEFAULTS and DEFAULTS[a.arg] is not None and _copies(d, DEFAULTS[a.arg])]
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.value is not None and stmt.target.id in DEFAULTS
                        and DEFAULTS[stmt.target.id] is not None
                        and _copies(stmt.value, DEFAULTS[stmt.target.id])):
                    found.append(f"line {stmt.lineno}: field {ast.unparse(stmt)}")
        elif (name := _env_get(node)) and len(node.args) > 1 and _copies(node.args[1], env.default(name)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            for left, right in zip(node.values, node.values[1:]):
                if (name := _env_get(left)) and _copies(right, env.default(name)):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            try:
                values = frozenset(_literal(node))
            except (ValueError, TypeError):
                continue
            found += [f"line {node.lineno}: the values of {name} {ast.unparse(node)}"
                      for name, choices in CHOICES.items() if values == choices]
    return found


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name != "env.py" or p.parent.name != "control"],
                         ids=_ids)
def test_no_default_of_the_table_is_written_again(path):
    found = copied_defaults(ast.parse(path.read_text(), filename=str(path)))
    assert not found, ("read these from tracker/control/env.py (env.default(NAME), Settings, "
                       f"env.SERVER_DEVICES): {found}")


def test_the_copy_finder_finds_copies():
    """The check above can fail: each kind of copy it looks for is found."""
    tree = ast.parse("def f(timeout: float = 300.0, *, chunk_bytes=2 << 20): pass\n"
                     "class C:\n    transport: str = 'auto'\n"
                     "x = environ.get('KVSTORE_LOG_LEVEL') or 'INFO'\n"
                     "y = environ.get('KVSTORE_HEARTBEAT_TIMEOUT', 10.0)\n"
                     "DEVICES = ('gpu', 'cpu')\n"
                     "ok = environ.get('KVSTORE_TIMEOUT', 30.0), f(timeout=1.0)\n")
    assert len(copied_defaults(tree)) == 6, copied_defaults(tree)

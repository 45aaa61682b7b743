"""No private field read across classes (issue 41, item 3).

A name that starts with one underscore (``_x``, not ``__x__``) belongs to the class
or module that defines it. This test walks the AST of every module of kvstore/ and
tracker/ and fails on a *reach*: a use of someone else's private name. The rule:

- ``obj._x`` (read, write or delete) and ``getattr/setattr/hasattr/delattr(obj,
  "_x", ...)`` with a literal name are reaches, unless ``obj`` is
  - ``self`` or ``cls`` inside a class that defines ``_x`` itself or through a
    base class of ours (found by name in kvstore/ and tracker/): a mixin that uses
    its host's fields, or a class that uses a third-party base's, is a reach;
  - ``super()``, or the enclosing class by its name;
  - a parameter annotated with the enclosing class (``def __eq__(self, other:
    "Key")``), or a local made by it (``new = cls(...)``, ``type(self)(...)``,
    ``Key(...)``, ``cls.__new__(cls)``, ``copy.copy(self)``), when that class
    defines ``_x``: the same class, whose own code owns the field;
- ``from M import _x`` is a reach unless M is in the importer's own package
  (``from ._util import _array_module`` inside kvstore/optimizer/): a package may
  keep helpers private to itself, nobody else may import them;
- a module's own private functions and globals (``_f()``, a bare name) are never
  reaches.

Names that look private but are public API are not reaches (PUBLIC,
PUBLIC_ATTRIBUTES). The reaches left are listed, each with its owner and why: into
our own classes in ALLOWED, as (file, code); into a third-party package that gives
no public way in THIRD_PARTY, as (file, private name). Any other reach fails, and
an entry whose reach is gone fails too (delete it, so that the reach cannot come
back). Entries name no line numbers: lines move as the files change.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Looks private, is public: what the rule must not count.
PUBLIC = {
    # the standard library's documented functions
    "os._exit", "sys._getframe",
}
PUBLIC_ATTRIBUTES = {
    # collections.namedtuple's documented methods and fields
    "_replace", "_asdict", "_fields", "_field_defaults", "_make",
    # MXNet's KVStore API spells these with an underscore (docs/api.md): public calls here too
    "_barrier", "_send_command_to_servers", "_set_updater",
}

# The reaches into our own classes left: (file, code) -> who owns the file, and what would remove it.
ALLOWED: dict[tuple[str, str], str] = {}

# Reaches into third-party packages, where they give no public way: (file, private name) -> why.
THIRD_PARTY = {
    ("kvstore/devices/arrays.py", "_C"):
        "torch's C binding (torch._C) holds the only current-raw-stream getter that does not build a "
        "Stream object per call",
    ("kvstore/devices/arrays.py", "_cuda_getCurrentRawStream"): "that getter, torch._C's",
    ("kvstore/rows/sparse.py", "_indices"):
        "torch's accessors of an uncoalesced sparse COO tensor (indices() refuses one; coalescing "
        "first would cost a sort)",
    ("kvstore/rows/sparse.py", "_values"): "as _indices",
    ("kvstore/torch.py", "_execution_engine"):
        "torch's autograd engine (torch.autograd.Variable._execution_engine.queue_callback) is the only "
        "way to run a callback when a backward ends, which DDP's and FSDP's Python code use as the "
        "Trainer does: its exchange finishes there",
    ("kvstore/torch.py", "_version"):
        "a tensor's version counter (Tensor._version), with which autograd itself detects in-place "
        "changes: torch has no public accessor; the Trainer (servers updating) detects with it a "
        "gradient edited after backward sent it",
    ("kvstore/torch.py", "_opt_called"):
        "torch's LR schedulers check the flag torch's own optimizer step sets; the servers stepped, "
        "so the Trainer sets it (torch has no public way)",
    ("kvstore/lightning.py", "_optimizers_to_device"):
        "what Lightning's own strategies call to move optimizer state to a device; Lightning exports "
        "no public equivalent",
}


def python_files() -> list[pathlib.Path]:
    return sorted((ROOT / "kvstore").rglob("*.py")) + sorted((ROOT / "tracker").rglob("*.py"))


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Reach:
    file: str
    line: int
    where: str       # the enclosing function's qualified name ("" at module level)
    code: str
    name: str        # the private name used

    @property
    def allowed(self) -> bool:
        return (self.file, self.code) in ALLOWED or (self.file, self.name) in THIRD_PARTY

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.where or '<module>'}: {self.code}"


# -- what each class defines ----------------------------------------------------------------------
def _base_names(cls: ast.ClassDef) -> list[str | None]:
    """Each base's class name (``a.B`` -> "B"; None for what is not a plain class name)."""
    names: list[str | None] = []
    for base in cls.bases:
        if isinstance(base, ast.Subscript):      # Generic[T], Protocol[T]
            base = base.value
        names.append(base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute)
                     else None)
    return names


NEUTRAL_BASES = {"object", "Generic", "Protocol", "ABC", "NamedTuple", "Enum", "IntEnum"}


def _own_names(cls: ast.ClassDef) -> set[str]:
    """The attributes a class defines: its body's functions, classes and assignments, and
    whatever its methods assign to ``self.x``/``cls.x`` (or ``setattr(self, "x", ...)``)."""
    names: set[str] = set()
    for statement in cls.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names |= {n.id for target in statement.targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            names.add(node.args[1].value)
    return names


class Classes:
    """Every class of the sources, by name (several classes may share one), and what
    each defines with its bases of ours."""

    def __init__(self, trees: dict[str, ast.Module]):
        self.by_name: dict[str, list[ast.ClassDef]] = {}
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.by_name.setdefault(node.name, []).append(node)
        self._cache: dict[int, set[str]] = {}

    def defined(self, cls: ast.ClassDef) -> set[str]:
        """The names ``cls`` defines, with those of its bases of ours (by name, transitively)."""
        if id(cls) not in self._cache:
            self._cache[id(cls)] = set()      # a base cycle by name (two classes called alike) ends here
            names = _own_names(cls)
            for base in _base_names(cls):
                for definition in self.by_name.get(base or "", []):
                    if definition is not cls:
                        names |= self.defined(definition)
            self._cache[id(cls)] = names
        return self._cache[id(cls)]


# -- the walk -------------------------------------------------------------------------------------
def _annotation_name(annotation: ast.expr | None) -> str | None:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip()
    if isinstance(annotation, ast.Name):
        return annotation.id
    return None


def _made_by_class(value: ast.expr, cls: ast.ClassDef) -> bool:
    """``Cls(...)``, ``cls(...)``, ``type(self)(...)``, ``cls.__new__(cls)`` /
    ``object.__new__(cls)``, ``copy.copy(self)``: an object of the enclosing class."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if ast.unparse(func) in ("copy.copy", "copy.deepcopy", "copy", "deepcopy"):
        return len(value.args) == 1 and isinstance(value.args[0], ast.Name) and value.args[0].id == "self"
    if isinstance(func, ast.Name):
        return func.id in (cls.name, "cls")
    if isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "type":
        return len(func.args) == 1 and isinstance(func.args[0], ast.Name) and func.args[0].id == "self"
    if isinstance(func, ast.Attribute) and func.attr == "__new__":
        return bool(value.args) and isinstance(value.args[0], ast.Name) and value.args[0].id in ("cls", cls.name)
    return False


class _Walker(ast.NodeVisitor):
    def __init__(self, file: str, package: str, classes: Classes):
        self.file, self.package, self.classes = file, package, classes
        self.scopes: list[ast.AST] = []           # enclosing classes and functions, outermost first
        self.same_class: list[set[str]] = []      # per function: names known to hold the enclosing class
        self.found: list[Reach] = []

    # scopes
    def _where(self) -> str:
        # the innermost function and the classes around it
        names, seen_function = [], False
        for scope in self.scopes:
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if seen_function:
                    continue              # a nested function counts as its outer one
                seen_function = True
            names.append(scope.name)      # type: ignore[attr-defined]
        return ".".join(names) if seen_function else ""

    def _class(self) -> ast.ClassDef | None:
        for scope in reversed(self.scopes):
            if isinstance(scope, ast.ClassDef):
                return scope
        return None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scopes.append(node)
        self.generic_visit(node)
        self.scopes.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        cls = self._class()
        same: set[str] = set()
        if cls is not None:
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            same = {a.arg for a in arguments if _annotation_name(a.annotation) in (cls.name, "Self")}
            for sub in ast.walk(node):
                if isinstance(sub, ast.Assign) and _made_by_class(sub.value, cls):
                    same |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name) and (
                        _annotation_name(sub.annotation) in (cls.name, "Self")
                        or (sub.value is not None and _made_by_class(sub.value, cls))):
                    same.add(sub.target.id)
        self.scopes.append(node)
        self.same_class.append(same | (self.same_class[-1] if self.same_class and self._nested() else set()))
        self.generic_visit(node)
        self.same_class.pop()
        self.scopes.pop()

    def _nested(self) -> bool:
        functions = [s for s in self.scopes if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return len(functions) > 1

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    # uses
    def _owned(self, obj: ast.expr, name: str) -> bool:
        """Whether ``obj._name`` here is the enclosing class's own field."""
        cls = self._class()
        if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super":
            return cls is not None
        if cls is None:
            return False
        if _made_by_class(obj, cls):
            return name in self.classes.defined(cls)
        if not isinstance(obj, ast.Name):
            return False
        if obj.id in ("self", "cls", cls.name) or (self.same_class and obj.id in self.same_class[-1]):
            return name in self.classes.defined(cls)
        return False

    def _check(self, node: ast.AST, obj: ast.expr, name: str) -> None:
        if not private(name) or name in PUBLIC_ATTRIBUTES:
            return
        if isinstance(obj, ast.Name) and f"{obj.id}.{name}" in PUBLIC:
            return
        if not self._owned(obj, name):
            self.found.append(Reach(self.file, node.lineno, self._where(), ast.unparse(node), name))  # type: ignore

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            self._check(node, node.args[0], node.args[1].value)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        origin = _absolute(self.package, node)
        inside = origin == self.package or origin.startswith(self.package + ".") if self.package else False
        for alias in node.names:
            if private(alias.name) and not inside:
                self.found.append(Reach(self.file, node.lineno, self._where(),
                                        f"from {node.module if not node.level else origin} import {alias.name}",
                                        alias.name))


def _absolute(package: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, absolute (``package``: the importer's)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _package(file: str) -> str:
    """The package a module of ours is in (a package's __init__ is in itself)."""
    parts = list(pathlib.PurePosixPath(file).with_suffix("").parts)
    return ".".join(parts[:-1])


def reaches(sources: dict[str, str]) -> list[Reach]:
    """Every reach in ``sources`` ({relative path: source}); the classes of all of
    them are known to each (a base class in another file counts)."""
    trees = {file: ast.parse(source, filename=file) for file, source in sources.items()}
    classes = Classes(trees)
    found: list[Reach] = []
    for file, tree in trees.items():
        walker = _Walker(file, _package(file), classes)
        walker.visit(tree)
        found += walker.found
    return found


ALL = reaches({str(p.relative_to(ROOT)): p.read_text() for p in python_files()})


# -- the checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reaches_into_another_class(path):
    file = str(path.relative_to(ROOT))
    new = [str(r) for r in ALL if r.file == file and not r.allowed]
    assert not new, "private names used outside their class or package (add a public seam):\n" + "\n".join(new)


def test_every_allowed_reach_still_exists():
    """An entry of ALLOWED or THIRD_PARTY whose reach is gone must go too, so that the
    reach cannot come back."""
    stale = [key for key in ALLOWED if key not in {(r.file, r.code) for r in ALL}] + \
        [key for key in THIRD_PARTY if key not in {(r.file, r.name) for r in ALL}]
    assert not stale, f"these reaches are gone: delete them from ALLOWED or THIRD_PARTY: {stale}"


def test_third_party_entries_name_no_field_of_ours_in_their_file():
    """A THIRD_PARTY entry lets a file use a private name on any object: sound only where
    no class of ours in that file defines the name (else ``x._name`` could be ours)."""
    for file, name in THIRD_PARTY:
        tree = ast.parse((ROOT / file).read_text())
        ours = [c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and name in _own_names(c)]
        assert not ours, f"{file}: {name} is also a field of {ours}: list its reaches in ALLOWED instead"


# -- the rule itself, on snippets -----------------------------------------------------------------
def codes(source: str, file: str = "kvstore/worker/x.py", **others: str) -> list[str]:
    sources = {file: source, **{f"kvstore/{name}.py": text for name, text in others.items()}}
    return [r.code for r in reaches(sources) if r.file == file]


def test_a_field_read_or_written_on_another_object_is_a_reach():
    source = '''
class Trainer:
    def __init__(self, kv):
        self._kv = kv
        self._timeline = getattr(kv, "_timeline", None)
        kv._type = "x"
    def step(self):
        self._kv._set_learning_rate(0.1)
        return self._timeline
'''
    assert codes(source) == ["getattr(kv, '_timeline', None)", "kv._type", "self._kv._set_learning_rate"]


def test_own_fields_same_class_objects_and_module_privates_are_not():
    source = '''
def _helper():
    return 1

class Key:
    _count = 0
    def __init__(self, value):
        self._value = value
        self._other = None
    def __eq__(self, other: "Key"):
        return self._value == other._value
    @classmethod
    def make(cls, value):
        new = cls(value)
        new._other = cls._count
        fresh = cls.__new__(cls)
        fresh._value = _helper()
        return new, fresh
    def copy(self):
        twin = Key(self._value)
        twin._other = type(self)(1)._value if False else None
        return twin
    def clone(self):
        return super()._clone() if hasattr(self, "_other") else None
'''
    assert codes(source) == []


def test_a_field_the_class_does_not_define_is_a_reach_even_through_self():
    """A mixin that uses its host's fields, or a parameter of the class whose field
    the class does not define, reaches."""
    source = '''
class Mixin:
    def describe(self):
        return self._host_field
class Key:
    def __init__(self):
        self._value = 1
    def same(self, other: "Key"):
        return other._missing
'''
    assert codes(source) == ["self._host_field", "other._missing"]


def test_a_base_class_of_ours_in_another_file_defines_fields_for_its_subclasses():
    base = '''
class Base:
    def __init__(self):
        self._keys = {}
'''
    source = '''
from .base import Base
class Store(Base):
    def keys(self):
        return self._keys
class Other:
    def keys(self, store: "Store"):
        return store._keys
'''
    assert codes(source, base=base) == ["store._keys"]


def test_private_imports_from_another_package_are_reaches_and_from_ones_own_are_not():
    source = '''
from ._util import _array_module
from . import _private_module
from ..server.checkpoint import _is_count
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from .public import name
'''
    assert codes(source) == ["from kvstore.server.checkpoint import _is_count",
                             "from lightning.fabric.utilities.optimizer import _optimizers_to_device"]


def test_public_names_spelled_private_are_not_reaches():
    source = '''
import os
import sys
def f(kv, record):
    kv._barrier()
    kv._send_command_to_servers("profile_start")
    frame = sys._getframe(1)
    os._exit(70)
    return record._replace(x=1)
'''
    assert codes(source) == []


def test_the_walk_finds_what_the_issue_counted():
    """The reaches issue 41 named, as they were written then, are found (and the fixed
    ones are gone from ALL)."""
    store = '''
class KVStore:
    def __init__(self, name):
        self._type = name
        self._config = None
        self._timeline = None
    def _set_learning_rate(self, lr, state_scale=1.0):
        pass
'''
    source = '''
def create(name):
    store = build(name)
    store._type = name.lower()
    return store
class Trainer:
    def __init__(self, kv):
        self._timeline = getattr(kv, "_timeline", None)
        self.kv = kv
    def _sync_learning_rate(self):
        self.kv._set_learning_rate(0.1, state_scale=1.0)
class Strategy:
    def setup(self, kv):
        return getattr(kv, "_config")
def _hyper(o):
    return o._mu
'''
    assert codes(source, store=store) == ["store._type", "getattr(kv, '_timeline', None)",
                                          "self.kv._set_learning_rate", "getattr(kv, '_config')", "o._mu"]
    fixed = {"store._type", "pace._links", "getattr(kv, '_config')"}
    assert not [str(r) for r in ALL if r.code in fixed]

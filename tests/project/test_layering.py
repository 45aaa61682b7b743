"""Imports only go down, checked from the source (not by running it) over every
module of kvstore/ and tracker/, imports inside functions (lazy ones) and under
``if TYPE_CHECKING:`` included:

- tracker never imports kvstore, and tracker/control never imports a launcher;
- every module of kvstore/ has a layer (LAYERS): the integrations on top
  (``kvstore``'s ``create``, ``torch``, ``lightning``, ``embedding``, ``tools/``);
  the worker side (``worker/``, ``hostgroup/``) and the server (``server/``) side by
  side, never importing each other; below both, ``rows/``, ``optimizer/``,
  ``protocol/``, ``devices/`` and ``transport/``, and the shared modules at the top
  of the package (``config``, ``errors``, ``modes``, ...), which import neither side
  nor an integration; and nothing but an integration imports an integration;
- no import cycle among modules (ALLOWED_CYCLES would name one left, and its owner);
- the pure layers import no sockets, threads or clocks, and nothing imports pickle.
"""

import ast
import pathlib

import pytest

from kvstore.transport.registry import TRANSPORTS

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


PURE = files("kvstore", "protocol") + files("kvstore", "sharding.py") + files("kvstore", "compression.py") + files("kvstore", "precision.py") + \
    files("kvstore", "server", "state.py") + files("kvstore", "server", "rounds.py") + \
    files("kvstore", "server", "write_in.py") + files("kvstore", "optimizer") + \
    files("kvstore", "server", "server_optimizer.py") + files("kvstore", "server", "snapshot.py") + \
    files("kvstore", "server", "stalls.py") + files("kvstore", "registry.py") + \
    files("kvstore", "server", "tables.py") + files("kvstore", "server", "ssp.py") + \
    files("kvstore", "rows", "layout.py") + files("kvstore", "rows", "rowinit.py") + \
    files("kvstore", "rows", "dynamic.py") + files("kvstore", "rows", "dyntable.py") + files("kvstore", "server", "dyntables.py") + \
    files("tracker", "control", "scheduler_state.py") + files("tracker", "control", "records.py") + \
    files("tracker", "control", "recovery.py") + files("tracker", "control", "failover.py") + \
    files("kvstore", "modes.py") + \
    [p for name in ("chunks", "modes", "consistency", "sync", "asyncmode", "members", "requests", "sequencer",
                    "replication", "numbering", "dyn_replicas")
     for p in files("kvstore", "server", f"{name}.py")] + files("tracker", "control", "elastic.py") + \
    files("tracker", "control", "start_again.py")


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_layers_have_no_io(path):
    forbidden = {"zmq", "socket", "threading", "time", "subprocess", "pickle", "tracker"}
    assert not {m for m in imported_modules(path) if m.split(".")[0] in forbidden}


@pytest.mark.parametrize("path", files("kvstore") + files("tracker"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_anywhere(path):
    assert not {m for m in imported_modules(path) if m.split(".")[0] in {"pickle", "cloudpickle", "dill"}}
    assert "shell=True" not in path.read_text()


# -- the module graph -------------------------------------------------------------------------
def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in files("kvstore") + files("tracker")}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def known(dotted: str) -> str | None:
    """The module of ours that ``dotted`` names (the longest known prefix: ``a.b.C``
    is module ``a.b``), or None for another package's."""
    parts = dotted.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) or None


def module_imports(name: str) -> set[str]:
    """Every module of ours that module ``name`` imports, anywhere in its source
    (top level, in functions, under TYPE_CHECKING). ``from P import x`` counts as
    module ``P.x`` when that is a module, else as ``P``. The parent packages that
    Python initialises on the way are not counted (every module would import
    ``kvstore/__init__.py``); an explicit ``from .. import x`` of a package is."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package(name) else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in MODULES else origin
                       for alias in node.names]
        found |= {m for m in map(known, targets) if m is not None and m != name}
    if name == "kvstore.transport.registry":    # its table names each transport's modules ("module:Class")
        found |= {f"kvstore.transport{where.partition(':')[0]}"
                  for t in TRANSPORTS.values() for where in (t.link, t.endpoint)}
    return found


GRAPH = {name: module_imports(name) for name in MODULES}


def test_the_graph_sees_lazy_and_relative_imports():
    """The walk finds what a reader would: a relative import of a module, one of a
    package, one inside a function, one under TYPE_CHECKING, the registry's table."""
    assert "kvstore.worker.checkpoints" in GRAPH["kvstore.worker.dist"]          # from .checkpoints import
    assert "kvstore.optimizer" in GRAPH["kvstore.server.server_optimizer"]         # from .. import optimizer
    assert "kvstore.worker.local" in GRAPH["kvstore"]                            # inside create()
    assert "kvstore.hostgroup.group" in GRAPH["kvstore.worker.exchange"]         # under TYPE_CHECKING
    assert "kvstore.transport.links.tcp_link" in GRAPH["kvstore.transport.registry"]
    assert all(m in MODULES for targets in GRAPH.values() for m in targets)


# -- layers ----------------------------------------------------------------------------------
INTEGRATIONS, WORKER, SERVER, BELOW, SHARED = "integration", "worker", "server", "below both", "shared"

LAYERS = {
    # what users import, above everything: create() and the roles (kvstore/__init__.py), the torch
    # integrations, the command-line tools
    "kvstore": INTEGRATIONS, "kvstore.torch": INTEGRATIONS, "kvstore.lightning": INTEGRATIONS,
    "kvstore.embedding": INTEGRATIONS, "kvstore.tools": INTEGRATIONS,
    # the worker's store and what it composes; the server
    "kvstore.worker": WORKER, "kvstore.hostgroup": WORKER,
    "kvstore.server": SERVER,
    # below both sides
    "kvstore.rows": BELOW, "kvstore.optimizer": BELOW, "kvstore.protocol": BELOW, "kvstore.devices": BELOW,
    "kvstore.transport": BELOW,
    # the few modules both ends share, at the top of the package
    "kvstore.checkpoint_sets": SHARED, "kvstore.compression": SHARED, "kvstore.precision": SHARED, "kvstore.config": SHARED,
    "kvstore.errors": SHARED, "kvstore.fileio": SHARED, "kvstore.flat_buckets": SHARED,
    "kvstore.modes": SHARED, "kvstore.registry": SHARED, "kvstore.sharding": SHARED,
    "kvstore.timeline": SHARED,
}

# layer -> the layers it must not import
FORBIDDEN = {
    INTEGRATIONS: set(),
    WORKER: {SERVER, INTEGRATIONS},
    SERVER: {WORKER, INTEGRATIONS},
    BELOW: {WORKER, SERVER, INTEGRATIONS},
    SHARED: {WORKER, SERVER, INTEGRATIONS},
}


def layer(name: str) -> str:
    """The layer of module ``name`` of kvstore: its own entry in LAYERS (a top-level
    module, or the package root), else its package's."""
    if name in LAYERS:
        return LAYERS[name]
    package = ".".join(name.split(".")[:2])
    if package not in LAYERS:
        raise KeyError(f"{name} has no layer: give {package} one in LAYERS (tests/project/test_layering.py) "
                       "and docs/architecture.md §1")
    return LAYERS[package]


KVSTORE = sorted(m for m in MODULES if m.split(".")[0] == "kvstore")


@pytest.mark.parametrize("name", KVSTORE)
def test_every_module_imports_only_what_its_layer_may(name):
    wrong = sorted(f"{target} ({layer(target)})" for target in GRAPH[name]
                   if target.split(".")[0] == "kvstore" and layer(target) in FORBIDDEN[layer(name)])
    assert not wrong, f"{name} ({layer(name)}) imports {', '.join(wrong)}"


def test_the_layer_rules_catch_what_the_issue_found():
    """The rules are not vacuous: the imports issue 41 item 4 found (now gone) would fail them."""
    assert SERVER in FORBIDDEN[layer("kvstore.worker.checkpoints")] and layer("kvstore.server.checkpoint") == SERVER
    assert WORKER in FORBIDDEN[layer("kvstore.rows.dist")] and layer("kvstore.worker.arguments") == WORKER
    assert WORKER in FORBIDDEN[layer("kvstore.server.tables")] and layer("kvstore.worker.types") == WORKER


# -- cycles ----------------------------------------------------------------------------------
ALLOWED_CYCLES: list[frozenset] = []     # none left (issue 41 item 4 removed the optimizer package's)


def cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_cycles_finds_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    new = [sorted(c) for c in cycles(GRAPH) if not any(c <= allowed for allowed in ALLOWED_CYCLES)]
    assert not new, f"import cycles (imports inside functions count): {new}"


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reachable(start) -> set[str]:
    """Every module the modules ``start`` import, directly or through others."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += GRAPH[module]
    return seen


def package_init_cycles() -> dict[str, list[str]]:
    """Cycles through a package's ``__init__``, which the graph leaves out (a parent
    package is no edge): package P's ``__init__`` imports a module outside P that
    imports, directly or not, a module inside P. Importing that outside module first
    initialises P half-way through it (P.x's import runs P's ``__init__``, which
    imports the module being imported). A package that re-exports its own modules
    is not such a cycle. By package: the modules inside it reached back."""
    found = {}
    for package in sorted(n for n in MODULES if is_package(n) and n not in ("kvstore", "tracker")):
        outside = {m for m in GRAPH[package] if not inside(m, package)}
        back = sorted(m for m in reachable(outside) if inside(m, package))
        if back:
            found[package] = back
    return found


def test_no_package_init_imports_back_into_its_package():
    """(issue 41: ``kvstore/transport/links/__init__.py`` imported the registry, whose
    table imports the links by name; the opening of links moved to links/opening.py)"""
    assert not package_init_cycles(), package_init_cycles()


def test_allowed_cycles_still_exist():
    """An entry of ALLOWED_CYCLES whose cycle is gone must go too (so that it cannot come back)."""
    found = cycles(GRAPH)
    stale = [sorted(allowed) for allowed in ALLOWED_CYCLES if not any(c <= allowed for c in found)]
    assert not stale, f"these cycles are gone: remove them from ALLOWED_CYCLES: {stale}"

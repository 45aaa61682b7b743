"""No benchmark experiment imports another (docs/architecture.md, "Benchmarks"):
what two experiments share lives in benchmarks/harness/. Checked from the AST of
every module, imports inside functions included."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")
SHARED = {"harness", "results"}


def _imported(tree: ast.AST, package: str) -> set[str]:
    """The benchmarks.X packages a module's imports name (relative ones resolved)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names = [f"benchmarks.{package}.{node.module or ''}"] if node.level == 1 else \
                    [f"benchmarks.{node.module or ''}"]
            else:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "benchmarks" and len(parts) > 1 and parts[1]:
                found.add(parts[1])
    return found


def test_no_experiment_imports_another():
    crossings = []
    for package in sorted(os.listdir(BENCH)):
        folder = os.path.join(BENCH, package)
        if package in SHARED or not os.path.isdir(folder) or package.startswith((".", "_")):
            continue
        for root, _, files in os.walk(folder):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(root, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read(), path)
                for other in _imported(tree, package) - {package} - SHARED:
                    crossings.append(f"{os.path.relpath(path, REPO)} imports benchmarks.{other}")
    assert not crossings, "\n".join(crossings)


def test_the_check_sees_a_crossing():
    tree = ast.parse("def f():\n    from benchmarks.link.report import VARIANTS\n")
    assert _imported(tree, "model") == {"link"}

"""Checkouts measured side by side in one run (benchmarks.per_key, benchmarks.emulated_ipc):
``--tree LABEL=DIR`` adds a checkout, e.g. a ``git worktree`` of an earlier commit,
beside this one (label ``this``); the benchmark alternates their jobs so that every
checkout sees the same load.

- ``tree_option``: the click option (repeatable); the command receives ``trees``, a
  tuple of ``LABEL=DIR`` strings.
- ``checkouts(values, repo)``: ``{label: directory}``, this checkout first; a malformed
  value, a label given twice or a directory without ``kvstore/`` is a usage error.
- ``commit(tree)``: the commit a checkout is at, ``+`` when it has uncommitted changes.

Example::

    git worktree add --detach /tmp/kv-before HEAD~3
    python -m benchmarks.emulated_ipc --tree before=/tmp/kv-before --repeats 3
"""

from __future__ import annotations

import os
import subprocess

import click

tree_option = click.option("--tree", "trees", multiple=True, metavar="LABEL=DIR",
                           help="also measure the checkout in DIR (e.g. a git worktree of an earlier commit)")


def checkouts(values, repo: str) -> dict[str, str]:
    trees = {"this": repo}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep or not label or label in trees or not os.path.isdir(os.path.join(path, "kvstore")):
            raise click.BadParameter(f"{value!r}: expected LABEL=DIR, a new label and a checkout with kvstore/",
                                     param_hint="--tree")
        trees[label] = os.path.abspath(path)
    return trees


def commit(tree: str) -> str:
    """The commit a checkout is at ("+" when it has uncommitted changes), or "?"."""
    try:
        head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+" if dirty else "")

"""Every Python and shell snippet of README.md and docs/*.md runs as written.

A fenced block is run unless its info string says why not: ```` ```bash no-run:
needs real hosts ````. The blocks of one file run in order in one fresh
directory, with this checkout on PYTHONPATH: a Python block whose first line is
``# NAME.py`` is written to that file (a later shell block runs it), any other
Python block runs with ``python -``, a shell block with ``bash -e``."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCK = re.compile(r"^```(python|bash)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
FILE_LINE = re.compile(r"#\s*([\w.-]+\.py)\s*$")


def blocks(path: str) -> list[tuple[int, str, str, str]]:
    """(line, language, info, body) of every python/bash block of ``path``."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2).strip(), m.group(3))
            for m in BLOCK.finditer(text)]


def test_the_snippet_finder_sees_the_readme_quick_start():
    found = blocks("README.md")
    assert any(lang == "python" and "kvstore.create" in body and not info for _, lang, info, body in found)
    assert all(info == "" or re.match(r"no-run: \S", info) for f in FILES for _, _, info, _ in blocks(f)), \
        "an info string other than 'no-run: <reason>'"


@pytest.mark.slow
@pytest.mark.timeout(300)   # docs/training.md: 4 Lightning processes and more (about 45 s alone on 2 cores,
# more than twice that beside 3 other xdist workers)
@pytest.mark.parametrize("path", [f for f in FILES if any(not info for _, _, info, _ in blocks(f))])
def test_snippets_run_as_written(path, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "KVSTORE_TIMEOUT": "60", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    for line, lang, info, body in blocks(path):
        if info:
            continue
        where = f"{path}:{line}"
        first = body.splitlines()[0] if body.strip() else ""
        named = FILE_LINE.match(first) if lang == "python" else None
        if named:
            (tmp_path / named.group(1)).write_text(body)
            continue
        argv = [sys.executable, "-"] if lang == "python" else ["bash", "-e", "-s"]
        p = subprocess.run(argv, input=body, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=180)
        assert p.returncode == 0, f"the snippet at {where} failed:\n{body}\n--- output:\n{p.stdout}{p.stderr}"

"""tests/scripts/shared_pipe.py, which the torchrun jobs print through: lines that
writers sharing one pipe write stay whole (print() let a peer's line land
between a line and its newline once, in CI), and what a pipe would not keep whole
is refused."""

import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)
from shared_pipe import write_lines  # noqa: E402

WRITER = """
import sys
from shared_pipe import write_lines
me = sys.argv[1]
for i in range(400):
    write_lines([f"{me} {i} " + me * 120, f"{me} {i} end"])
"""


def test_two_writers_sharing_one_pipe_never_split_a_line():
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": SCRIPTS, "PYTHONUNBUFFERED": "1"}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, me], stdout=write, env=env) for me in "ab"]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    for me in "ab":
        mine = [line for line in lines if line.startswith(me + " ")]
        assert mine == [x for i in range(400) for x in (f"{me} {i} " + me * 120, f"{me} {i} end")]
    assert len(lines) == 1600


def test_more_than_a_pipe_keeps_whole_is_refused():
    import select
    with pytest.raises(ValueError, match="keeps only"):
        write_lines(["x" * select.PIPE_BUF])

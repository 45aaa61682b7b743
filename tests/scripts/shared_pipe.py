"""Lines a test job's process writes whole into a pipe it shares with its peers
(under torchrun every worker's stdout is the one pipe the test reads).

print() is no single write: with line buffering (torchrun's children have it) it
flushes the text at its last newline and writes the final "\\n" on its own, so a
peer's output can land between ("rank 1 listens on []rank 0 of 2: ..."), which
once failed a torchrun test in CI. One write(2) of at most PIPE_BUF bytes to a
pipe is atomic (POSIX), so the lines here go in one os.write.

    from shared_pipe import write_lines
    write_lines([f"rank {rank} of 2: pulled 3 3", f"rank {rank} secret none"])
"""

from __future__ import annotations

import os
import select
import sys


def write_lines(lines: list[str]) -> None:
    """Writes ``lines``, each ended by a newline, in one write(2) to standard output;
    refuses more than PIPE_BUF bytes, which a pipe would not keep whole."""
    data = "".join(line + "\n" for line in lines).encode()
    if len(data) > select.PIPE_BUF:
        raise ValueError(f"{len(data)} bytes: a pipe keeps only {select.PIPE_BUF} whole in one write")
    sys.stdout.flush()                      # what print() left in the buffer goes first
    written = os.write(sys.stdout.fileno(), data)
    if written != len(data):
        raise OSError(f"wrote {written} of {len(data)} bytes to standard output")

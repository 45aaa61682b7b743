"""Where an experiment writes its result files: a new scratch directory unless told.

Every experiment of benchmarks/ takes the same two options, from here:

- ``--out-dir DIR``: write into DIR (made if missing);
- ``--record``: write into its directory under benchmarks/results (the runs of
  record, committed and quoted by the docs);
- neither: a new scratch directory (``kvstore-<experiment>-*`` in the system's
  temporary directory), named on stderr, so that trying an experiment never
  overwrites a committed result.

Both at once is a usage error. A click command takes them with
``@OUTPUT.click_options`` (its function receives ``out_dir``, already chosen), or,
where the same command also runs as a job's worker and must choose nothing there,
with ``@OUTPUT.click_flags`` (it receives ``out_dir`` and ``record`` and calls
``OUTPUT.choose``); an argparse one with ``OUTPUT.add_arguments(parser)`` and
``OUTPUT.chosen(parser, args)``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.harness.common import REPO, RESULTS


class BothGiven(ValueError):
    """``--out-dir`` and ``--record`` were both given."""


@dataclass(frozen=True)
class ResultsDir:
    """One experiment's destinations. ``experiment`` names its scratch directories;
    ``record_to`` is its directory under benchmarks/results ("" for that directory
    itself, as the pushpull benchmark's files of record are)."""

    experiment: str
    record_to: str

    @property
    def record_dir(self) -> str:
        """The absolute path ``--record`` writes into."""
        return os.path.join(RESULTS, self.record_to) if self.record_to else RESULTS

    def help(self) -> tuple[str, str]:
        """The help texts of ``--out-dir`` and ``--record``."""
        return (f"Write the results into this directory [default: a new scratch directory, "
                f"kvstore-{self.experiment}-* under {tempfile.gettempdir()}].",
                f"Write the results into {os.path.relpath(self.record_dir, REPO)}, the runs of record.")

    def choose(self, out_dir: str | None, record: bool) -> str:
        """The directory to write into, made if missing; a new scratch directory when
        neither is given (its path on stderr). Raises BothGiven for both."""
        if record and out_dir:
            raise BothGiven(f"--out-dir {out_dir} and --record name two destinations: give one "
                            f"(--record writes {os.path.relpath(self.record_dir, REPO)})")
        if record:
            chosen = self.record_dir
        elif out_dir:
            chosen = os.path.abspath(out_dir)
        else:
            chosen = tempfile.mkdtemp(prefix=f"kvstore-{self.experiment}-")
            print(f"results go to the scratch directory {chosen} "
                  f"(--record: {os.path.relpath(self.record_dir, REPO)})", file=sys.stderr, flush=True)
        os.makedirs(chosen, exist_ok=True)
        return chosen

    def click_flags(self, command: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator (below ``@click.command``): adds ``--out-dir`` (``out_dir``, None
        when not given) and ``--record`` (``record``); choosing is left to ``command``."""
        import click   # here: the peers' virtual environments import the harness without click
        out_help, record_help = self.help()
        command = click.option("--record", is_flag=True, help=record_help)(command)
        return click.option("--out-dir", type=click.Path(file_okay=False), default=None, help=out_help)(command)

    def click_options(self, command: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator (below ``@click.command``): adds ``--out-dir`` and ``--record``
        and calls ``command`` with ``out_dir``, the chosen directory."""
        @functools.wraps(command)
        def chosen(*args: Any, out_dir: str | None, record: bool, **kwargs: Any) -> Any:
            return command(*args, out_dir=self.click_choose(out_dir, record), **kwargs)

        return self.click_flags(chosen)

    def click_choose(self, out_dir: str | None, record: bool) -> str:
        """``choose`` in a click command: both given is a click.UsageError."""
        import click
        try:
            return self.choose(out_dir, record)
        except BothGiven as e:
            raise click.UsageError(str(e)) from None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Adds ``--out-dir`` and ``--record`` to an argparse parser."""
        out_help, record_help = self.help()
        parser.add_argument("--out-dir", default=None, help=out_help.replace("%", "%%"))
        parser.add_argument("--record", action="store_true", help=record_help.replace("%", "%%"))

    def chosen(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
        """The directory for parsed ``args`` (as ``choose``); both given: ``parser.error``."""
        try:
            return self.choose(args.out_dir, args.record)
        except BothGiven as e:
            parser.error(str(e))
            raise   # parser.error exits; for the type checker

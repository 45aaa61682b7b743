"""Command-line options that several experiments share, defined once (click).

- ``comma_choices(known, what)``: a callback for an option taking a comma-separated
  list of names, each one of ``known``; the command receives the list, and an unknown
  name is a usage error (``unknown <what>(s) a, b``).
- ``exchange_options(workers=, launches=)``: the ResNet-50 exchange measured side by
  side over launches (benchmarks.deterministic, benchmarks.mixed_precision): ``-w``,
  ``-s``, ``--model``, ``--iters``, ``--warmup``, ``--launches``, ``--transports`` (of
  our transports) and ``--timeout``.
- ``layout_options(layouts, workers=, servers=, iters=, warmup=)``: ResNet-50's values
  in key layouts (key_layouts.py) divided by a scale (benchmarks.per_key,
  benchmarks.emulated_ipc): ``--layouts``, ``--scale``, ``--workers``, ``--servers``,
  ``--iters``, ``--warmup``.

The option decorators go below ``@click.command`` and list their options in that
order (``--help`` shows them so).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import click

from benchmarks.harness.contenders import ours

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def comma_choices(known: Iterable[str], what: str) -> Callable[[click.Context, click.Parameter, str], list[str]]:
    """A click callback: ``"a,b"`` -> ``["a", "b"]`` (empty items dropped), each one of
    ``known``, else click.BadParameter naming the unknown ones and the option."""
    names = tuple(known)

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        items = [v for v in value.split(",") if v]
        unknown = [v for v in items if v not in names]
        if unknown:
            raise click.BadParameter(f"unknown {what}(s) {', '.join(unknown)}", param_hint=param.opts[-1])
        return items
    return parse


def _stacked(*options: Decorator) -> Decorator:
    """The options as one decorator, in the order given (as if written one above the other)."""
    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            command = option(command)
        return command
    return apply


def exchange_options(*, workers: int, launches: int) -> Decorator:
    """The side-by-side exchange's job and sampling options (the defaults given here,
    the rest shared): the command receives ``workers``, ``servers``, ``model``,
    ``iters``, ``warmup``, ``launches``, ``transports`` (a list of names of
    ``ours.TRANSPORTS``) and ``timeout``."""
    return _stacked(
        click.option("-w", "--workers", type=click.IntRange(min=1), default=workers, show_default=True),
        click.option("-s", "--servers", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50", show_default=True),
        click.option("--iters", type=click.IntRange(min=1), default=8, show_default=True),
        click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True),
        click.option("--launches", type=click.IntRange(min=1), default=launches, show_default=True),
        click.option("--transports", default="shm,tcp", show_default=True,
                     callback=comma_choices(ours.TRANSPORTS, "transport"),
                     help=f"Comma-separated, of {', '.join(ours.TRANSPORTS)}."),
        click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True))


def layout_options(layouts: tuple[str, ...], *, workers: int, servers: int, iters: int, warmup: int) -> Decorator:
    """The key-layout experiments' options: ``layouts`` (a list, of ``layouts``, all by
    default), ``scale`` (every size divided by it), ``workers``, ``servers``, ``iters``
    and ``warmup`` (their defaults given here)."""
    return _stacked(
        click.option("--layouts", default=",".join(layouts), show_default=True,
                     callback=comma_choices(layouts, "layout"), help="comma-separated, of: " + ", ".join(layouts)),
        click.option("--scale", type=click.IntRange(min=1), default=64, show_default=True,
                     help="divide every size by this"),
        click.option("--workers", type=click.IntRange(min=1), default=workers, show_default=True),
        click.option("--servers", type=click.IntRange(min=1), default=servers, show_default=True),
        click.option("--iters", type=click.IntRange(min=1), default=iters, show_default=True),
        click.option("--warmup", type=click.IntRange(min=0), default=warmup, show_default=True))

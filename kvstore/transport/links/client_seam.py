"""What a link needs of the worker's client: :class:`LinkClient`, declared here so
that the links (below the worker) depend on this interface, not on
:class:`kvstore.worker.client.Client` (above them), which is one implementation of it
(mypy checks that it is where the client hands itself to its links).

A link sends its own requests (handshakes, write-in's ``write`` and ``written``)
through the client, which owns the sockets, the request ids and the replies, and
waits on them there; it shares per-process resources with the links of its kind
(``shared``: the shared-memory arena, the device arena); it reads the client's
``config``, ``rank`` (for its messages), ``links`` (every server's link: a
handshake that fell back replaces one), ``accelerators`` (the process's GPUs, or
None) and ``traffic`` (bytes sent, by transport).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .options import RequestOptions

if TYPE_CHECKING:
    from ...devices.base import Accelerators
    from ..traffic import Traffic


class LinkClient(Protocol):
    """The worker's client as its links see it (kvstore.worker.client.Client)."""

    # kvstore.config.Config, not imported: the config imports the transport registry, whose
    # table names the links, so the type would close an import cycle (tests/project/test_layering.py)
    config: Any
    rank: int
    links: list
    accelerators: Accelerators | None
    traffic: Traffic

    def request(self, server: int, op: str, what: str, arrays=(), options: RequestOptions = ...,
                **fields) -> Any:
        """Send request ``op`` to ``server``; its id (and a tracker), as the client returns it."""
        ...

    def wait(self, ids: Iterable, what: str, raising: bool = True) -> None:
        """Wait for the replies to ``ids`` (errors raised, naming ``what``)."""
        ...

    def progress(self, what: str, timeout: float = 0) -> None:
        """Handle the replies that have arrived (grants to write among them)."""
        ...

    def shared(self, name: str, make: Callable) -> Any:
        """What the links of one transport share, made by ``make`` on first use."""
        ...

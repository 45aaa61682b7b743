"""The worker's side of the transports: one :class:`~.base.Link` class per file.

Each is registered, with the server's endpoint of the same transport, in
:data:`kvstore.transport.registry.TRANSPORTS`, most preferred first. For each
server the client tries, in that order, every link whose ``reach`` accepts the
server's advert, starting at the one ``KVSTORE_TRANSPORT`` names (``auto``: the
first); a link whose handshake fails falls back to the next (:func:`kvstore.transport.links.opening.candidates`; this package's ``__init__``
imports neither the registry nor the opening, so that the registry's lazy imports of
the links make no cycle through it).
Modules are imported when first chosen, so a transport's optional dependencies
(e.g. CuPy) cost nothing where it is not used.

A new transport's worker side is one new file here (a ``Link`` subclass: ``kind``
= its registered name, ``reach``, and whichever of ``hello``/``ready``/``prepare``/
``release``/``decode``/``deliver``/``close`` it changes); the registry's line names
it (docs/architecture.md §4.1).
"""

from __future__ import annotations

from .base import Link, LinkUnavailable
from .options import PLAIN, RequestOptions

__all__ = ["PLAIN", "Link", "LinkUnavailable", "RequestOptions"]

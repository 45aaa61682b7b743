"""Opening a worker's links to the servers: each server's candidate links in the
order ``KVSTORE_TRANSPORT`` and the registry give (:func:`candidates`), every
server's handshakes at once, and a fall back to the next candidate when one fails
(:func:`open_links`). Apart from the package's ``__init__`` so that the registry,
which imports the links lazily by name, and the links' package make no cycle.
"""

from __future__ import annotations

import logging

from ...errors import ProtocolError
from .. import registry
from ..endpoints import host_identity
from .base import Link, LinkUnavailable
from .client_seam import LinkClient

log = logging.getLogger(__name__)


def candidates(advert, config, colocated: bool) -> list[tuple[type[Link], str]]:
    """(Link class, URL) for each link that may reach the server of ``advert``, in the
    order the client tries them: from the one ``config.transport`` names on (``auto``:
    from the first). Never empty while the last link (tcp) reaches every advert."""
    found = []
    for name in registry.chosen(config.transport):     # ConfigError for a name not registered
        cls = registry.link(name, Link)
        url = cls.reach(advert, config, colocated)
        if url:
            found.append((cls, url))
    return found


def open_links(client: LinkClient, sockets, adverts) -> None:
    """Give every server a link in ``client.links``: its first candidate whose
    handshake succeeds. All servers' handshakes run at once (``client.wait``); a
    server whose link failed tries its next candidate in the next pass, on its
    socket in ``sockets`` (a transport.sockets.Sockets), connected afresh when the
    URL differs: only unsequenced handshake requests went out on the old one, so a
    fresh one starts at seq 0 like any other. ``adverts``: by server rank, a list
    (every server) or a dict (those servers only: a replacement that joined)."""
    local = host_identity(client.config.host_label)
    tries = {s: [(cls, url) for cls, url in candidates(a, client.config, a.host is not None and a.host == local)
                 if cls.applies(client)]
             for s, a in (adverts.items() if isinstance(adverts, dict) else enumerate(adverts))}
    while tries:
        started, ids = [], []
        for s in sorted(tries):
            if not tries[s]:
                raise ProtocolError(f"no transport reaches server {s} ({adverts[s].format()})")
            cls, url = tries[s].pop(0)
            if client.links[s] is None or url != client.links[s].url:
                sockets.connect(s, url)
            client.links[s] = link = cls(client, s, url, adverts[s])
            try:
                ids += link.hello()
                started.append(link)
            except LinkUnavailable as e:
                _fall_back(link, e, tries[s])
        client.wait(ids, "the handshakes with the servers")
        for link in started:
            try:
                link.ready()
                del tries[link.server]
            except LinkUnavailable as e:
                _fall_back(link, e, tries[link.server])


def _fall_back(link: Link, error: LinkUnavailable, rest: list) -> None:
    link.close()
    log.warning("[worker:%d] %s; using %s", link.client.rank, error,
                rest[0][0].kind if rest else "nothing else")


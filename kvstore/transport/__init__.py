"""How bytes move between workers and servers (frames and memory, no keys).

- :mod:`.registry`: THE table of transports, each a pair: the worker's link and
  the server's endpoint, by name, most preferred first; the valid values of
  ``KVSTORE_TRANSPORT``.
- :mod:`.endpoints`: the server's side, one class per transport (what it binds and
  advertises, the handshakes it answers, how its replies go), the advert (each
  transport's fields by name), the host identity.
- :mod:`.shm`: shared memory for co-located peers: anonymous memory files
  (memfd) owned by one process and mapped by its peers, an allocator for them,
  and per-chunk staging slots.
- :mod:`.memory`: glibc malloc settings that stop large ZeroMQ frames from
  being page-faulted in afresh for every message.
- :mod:`.channel`: data channels, plain TCP connections for large replies.
- :mod:`.links`: the worker's side, one class per transport (shared memory, ipc,
  tcp); :mod:`.sockets`: the worker's DEALER per server.

The client (:mod:`kvstore.worker.client`, through its links) and the server node
(:mod:`kvstore.server`, through ``server/dataplane.py``, which composes the
endpoints) combine these with the wire codec; docs/architecture.md ("Transports")
explains the choice and how to add a transport, docs/protocol.md the header fields
they add.
"""

from .endpoints import Advert, bind, host_identity

__all__ = ["Advert", "bind", "host_identity"]

"""How bytes move between workers and servers (frames and memory, no keys).

- :mod:`.endpoints`: what a server binds (tcp, and an ipc endpoint for its own
  host), the advert it registers, the host identity.
- :mod:`.shm`: shared memory for co-located peers: anonymous memory files
  (memfd) owned by one process and mapped by its peers, an allocator for them,
  and per-chunk staging slots.
- :mod:`.memory`: glibc malloc settings that stop large ZeroMQ frames from
  being page-faulted in afresh for every message.
- :mod:`.channel`: data channels, plain TCP connections for large replies.
- :mod:`.links`: the worker's side, one class per transport (shared memory, ipc,
  tcp) behind a registry; :mod:`.sockets`: the worker's DEALER per server.

The client (:mod:`kvstore.client`, through its links) and the server node
(:mod:`kvstore.server`, through ``server/dataplane.py``) combine these with the
wire codec; docs/architecture.md ("Transports") explains the choice and how to
add a transport, docs/protocol.md the header fields they add.
"""

from .endpoints import MODES, Advert, bind, host_identity

__all__ = ["MODES", "Advert", "bind", "host_identity"]

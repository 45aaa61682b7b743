"""How bytes move between workers and servers (frames and memory, no keys).

- :mod:`.endpoints`: what a server binds (tcp, and an ipc endpoint for its own
  host), the advert it registers, the host identity, and which endpoint a worker
  picks (``KVSTORE_TRANSPORT``).
- :mod:`.shm`: shared memory for co-located peers: anonymous memory files
  (memfd) owned by one process and mapped by its peers, an allocator for them,
  and per-chunk staging slots.
- :mod:`.memory`: glibc malloc settings that stop large ZeroMQ frames from
  being page-faulted in afresh for every message.

The client (:mod:`kvstore.client`) and the server node (:mod:`kvstore.server`)
combine these with the wire codec; docs/architecture.md ("Transports") explains
the choice, docs/protocol.md the header fields they add.
"""

from .endpoints import MODES, Advert, bind, choose, host_identity

__all__ = ["MODES", "Advert", "bind", "choose", "host_identity"]

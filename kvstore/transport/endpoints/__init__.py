"""The server's side of the transports, and what a server advertises.

- :mod:`.advert`: the :class:`Advert` (each served transport's fields by name,
  the host identity, the pid), :func:`host_identity`, :func:`bind` (tcp and ipc
  for sockets outside the data plane).
- :mod:`.base`: :class:`Endpoint`, the interface of a server's side of one
  transport; one subclass per file (``shm_endpoint``, ``ipc_endpoint``,
  ``tcp_endpoint``), registered with its worker link in
  :mod:`kvstore.transport.registry`. ``kvstore/server/dataplane.py`` composes them.
- :mod:`.owners`: :class:`~.owners.MemoryOwners`, whose memory a request may pass by
  reference (its sending worker's own), which the data plane checks for every endpoint.
"""

from .advert import Advert, bind, bind_ipc, bind_tcp, host_identity
from .base import Endpoint

__all__ = ["Advert", "Endpoint", "bind", "bind_ipc", "bind_tcp", "host_identity"]

"""What a worker's request asks of the client and of its link: :class:`RequestOptions`.

``Client.request`` (kvstore.worker.client) takes one, and hands it to the link's
``prepare`` (kvstore.transport.links.base), which reads what the request's arrays
may become and where its reply goes. It lives below both, with the links, because
the worker's layer is above the transport's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class RequestOptions:
    """How the client sends one request and takes its reply: the options of
    ``Client.request`` (kvstore.worker.client), in one record that the link's
    ``Link.prepare`` reads too. The defaults are a plain request whose reply
    only acknowledges it.

    What its arrays become on the way (the link decides):

    - ``stage``: keys (chunk ids) naming the arrays, for a link that copies them
      into its shared memory first;
    - ``in_place``: arrays that already lie in our shared memory (``kv.empty()``)
      may go by reference; the caller leaves them unchanged until the reply;
    - ``shared``: where the arrays lie in our shared memory (``protocol.encode``'s
      places), set by the caller;
    - ``track``: the client returns ZeroMQ's MessageTracker, to wait until ZeroMQ
      let go of the caller's buffers.

    Its reply:

    - ``into``: where the reply's arrays go (one contiguous 1-D array each),
      delivered by the link (over a data channel, received straight into them);
    - ``on_reply(header, arrays)``: called with the reply;
    - ``on_error(error)``: called with its error instead of raising it at the next wait;
    - ``urgent``: handled before other replies that came with it (other workers
      wait on it: a write's grant);
    - ``reads``: the chunk ids whose values its reply (or a request its reply
      sends) carries; by default its ``chunks`` when it has ``into``.

    Its order:

    - ``sequenced=False``: no per-connection sequence number (a handshake request
      that may fail before the server's sequencer sees it);
    - ``follows``: the request whose reply handler sends this one; if that call
      gave up, so has this one.

    A caller makes one per request (or shares one it never changes, as :data:`PLAIN`);
    nothing changes it afterwards. (Not frozen: a frozen dataclass costs ten times
    as much to make, a few microseconds per message.)

    Example::

        client.request(server, ops.PULL, "pull of key 3", (), RequestOptions(into=[out]), chunks=[[3, 0]])
    """
    stage: list | None = None
    in_place: bool = False
    shared: list | None = None
    track: bool = False
    into: list | None = None
    on_reply: Callable | None = None
    on_error: Callable | None = None
    urgent: bool = False
    reads: list | None = None
    sequenced: bool = True
    follows: int | None = None

    @property
    def replied(self) -> bool:
        """Whether the reply carries something the caller reads (values or a handler)."""
        return self.on_reply is not None or self.into is not None


PLAIN = RequestOptions()      # a plain request (the default): never changed

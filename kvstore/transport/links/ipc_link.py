"""ZeroMQ over the server's abstract ipc endpoint: a co-located server, frames
through the kernel without the tcp stack (``KVSTORE_TRANSPORT=ipc``, and where
shared memory failed)."""

from __future__ import annotations

from .base import Link


class IpcLink(Link):
    kind = "ipc"

    @classmethod
    def reach(cls, advert, config, colocated: bool) -> str | None:
        return advert.url(cls.kind) if colocated else None

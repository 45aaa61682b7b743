"""The part of :class:`kvstore.dist.DistStore` that sums on the host first
(``KVSTORE_HOST_REDUCE=1``): forming the host group after registration, and the
store's side of :class:`kvstore.hostreduce.HostGroup` (the leader's push of a
host's sum, filling it, and taking replies in)."""

from __future__ import annotations

from .protocol import ops


class HostGrouped:
    """A mixin of DistStore (``_host``, ``_client``, ``_membership``, ``_send``, ``_fill``)."""

    def _join_host_group(self, registration) -> None:
        host, self._host = self._host, None
        if host.form(registration, self._membership):
            host.attach(self._push_for_host, self._fill_for_host, self._replied_for_host,
                        self._client.progress)
            self._client.before_flush = host.flush
            self._host = host

    @property
    def host_group(self) -> tuple:
        """The ranks of the workers whose pushpulls this host sums before pushing
        (``KVSTORE_HOST_REDUCE=1``; the lowest pushes for all), or () when none."""
        return self._host.ranks if self._host is not None else ()

    def _push_for_host(self, what, sources, targets, group) -> tuple:
        return self._send(ops.PUSHPULL, what, sources, targets, paced=True, group=group)

    def _fill_for_host(self, handle) -> list:
        self._fill(handle)
        return [flat for _, flat, _ in handle.fills]

    def _replied_for_host(self, handle) -> bool:   # handle: DistStore._send's Sent
        return self._client.replied(handle.ids + handle.later)

    def _host_stats(self) -> dict:
        """comm_stats' bytes to and from the group's others (none without a group)."""
        if self._host is None:
            return {}
        return {"host_bytes_sent": self._host.bytes_sent, "host_bytes_received": self._host.bytes_received}

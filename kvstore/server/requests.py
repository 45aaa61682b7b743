"""Reading a request's common fields, and the plain acknowledgement.

Pure functions shared by the server's collaborators (kvstore.server.state and the
ones it hands requests to): each raises ProtocolError naming the field that is
wrong, so a malformed request is refused before anything changes.
"""

from __future__ import annotations

from ..errors import ProtocolError
from ..protocol import ops
from .rounds import Reply, is_int


def ok(peer, req_id, arrays=(), **fields) -> Reply:
    """The success reply to request ``req_id`` of ``peer``, with ``arrays`` and ``fields``."""
    return Reply(peer, {"op": ops.OK, "id": req_id, **fields}, list(arrays))


def chunk_ids(header: dict, arrays: list | None) -> list[tuple]:
    """The request's ``chunks``, as (key, index) tuples, distinct and (when ``arrays``
    is given) one per buffer."""
    raw = header["chunks"]
    if not isinstance(raw, list):
        raise ProtocolError("'chunks' must be a list")
    ids = []
    for item in raw:
        # (exact types first, as msgpack makes them: is_int twice a chunk cost ~1 us)
        if not (isinstance(item, list) and len(item) == 2
                and (type(item[1]) is int or is_int(item[1]))
                and (type(item[0]) in (int, str) or is_int(item[0]) or isinstance(item[0], str))):
            raise ProtocolError(f"bad chunk id {item!r}: expected [key, index]")
        ids.append((item[0], item[1]))
    if len(set(ids)) != len(ids):
        raise ProtocolError("a chunk appears twice in one request")
    if arrays is not None and len(arrays) != len(ids):
        raise ProtocolError(f"{len(ids)} chunks but {len(arrays)} buffers")
    return ids


def worker_of(header: dict, num_workers: int) -> int:
    """The sender's worker rank (``src``), one of ``num_workers`` ranks."""
    src = header["src"]
    if not is_int(src) or not 0 <= src < num_workers:
        raise ProtocolError(f"'src' must be the sender's worker rank (0..{num_workers - 1}), "
                            f"got {src!r}")
    return src


def reply_values(peer, req_id, backend, chunks, want_values: bool, copy: bool) -> Reply:
    """The reply to ``req_id`` with the values of ``chunks`` (none unless
    ``want_values``), downloaded from ``backend`` (``copy``: not views on them)."""
    return ok(peer, req_id, backend.download([c.value for c in chunks], copy) if want_values else [])


def pushes_field(header: dict, count: int) -> list:
    """A replicate request's ``pushes`` (dist_async: per round of ``count``, the push
    it is, ``[worker, its number]``, or null; absent: all null)."""
    pushes = header.get("pushes", [None] * count)
    if not (isinstance(pushes, list) and len(pushes) == count and all(
        p is None or (isinstance(p, list) and len(p) == 2 and all(is_int(x) and x >= 0 for x in p)) for p in pushes)):
        raise ProtocolError("'pushes' must be a list with one [worker, number] (or null) per round")
    return pushes

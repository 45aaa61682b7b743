"""Control-plane messages between nodes and the scheduler.

One ZeroMQ frame holding a msgpack map ``{"v": VERSION, "op": str, ...}``.
The control plane carries only small metadata, never arrays, never pickle.
"""

from __future__ import annotations

import msgpack

from .errors import RendezvousError

VERSION = 1
MAX_BYTES = 1 << 20

# the ops, one name each (docs/protocol.md §8.1): a node's requests ...
HEARTBEAT, REGISTER, BARRIER, FINISH, FAIL, PROGRESS = (
    "heartbeat", "register", "barrier", "finish", "fail", "progress")
REQUESTS = (HEARTBEAT, REGISTER, BARRIER, FINISH, FAIL, PROGRESS)
# ... and what the scheduler sends: replies, and pushes on a node's heartbeat socket
REGISTERED, BARRIER_DONE, FINISHED, ACK, ERROR = "registered", "barrier_done", "finished", "ack", "error"
SHUTDOWN, ABORT, WORKERS_FINISHED, MEMBERS = "shutdown", "abort", "workers_finished", "members"
SERVERS = "servers"    # replicated servers: a new epoch of who serves each share (tracker.control.failover)
# an error reply's kind (docs/protocol.md §8.1): what the node raises for it
ABORTED, MISMATCH, TIMEOUT, INVALID = "aborted", "mismatch", "timeout", "invalid"
RESTARTING = "restarting"   # a restarted scheduler waits for the members: sent again after registering again


def encode(op: str, **fields) -> bytes:
    return msgpack.packb({"v": VERSION, "op": op, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict:
    """Decode one control message; raise RendezvousError on anything malformed."""
    if len(frame) > MAX_BYTES:
        raise RendezvousError(f"control message of {len(frame)} bytes exceeds {MAX_BYTES}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise RendezvousError(f"undecodable control message: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise RendezvousError("control message is not a map with an 'op'")
    if msg.get("v") != VERSION:
        raise RendezvousError(
            f"control protocol version {msg.get('v')!r} does not match ours ({VERSION}); "
            "all processes of a job must run the same kvstore version")
    return msg

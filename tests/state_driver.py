"""Shared helpers of the ServerState tests (test_server_state*.py); not collected.

``Server`` drives a ``kvstore.server.state.ServerState`` the way the I/O loop does:
one request at a time, as (peer, header, arrays) exactly as handed over after
decode(), returning the replies that are ready. ``only``, ``expect_ok``,
``expect_error`` and ``by_id`` check those replies; ``A``, ``B`` and ``C`` are chunk
ids, ``peer(src)`` the bytes identity a ZeroMQ ROUTER would see for worker ``src``.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvstore import optimizer
from kvstore.protocol import ops
from kvstore.server.state import Reply, ServerState


A = ("w", 0)          # str key, chunk 0
B = ("w", 1)          # same key, chunk 1
C = (7, 0)            # int key
F32 = np.float32


def peer(src):
    return b"w%d" % src


def vec(*values, dtype=F32):
    return np.array(values, dtype=dtype)


# the backend Server() builds when none is given: None = the host backend; tests that
# run on the device layer's host device too set it (see device_backends() below)
BACKEND = None


class Server:
    """Drives a ServerState the way the I/O loop does: one request at a time."""

    def __init__(self, mode="sync", num_workers=3, opt=None, init=None, write_in=False, staleness=None,
                 deterministic=None, **state_args):
        if "backend" not in state_args and BACKEND is not None:
            state_args["backend"] = BACKEND()
        self.state = ServerState(name="server 0", write_in=write_in, **state_args)
        self._ids = itertools.count(1)
        _, r = self.send(0, ops.CONFIGURE, mode=mode, num_workers=num_workers,
                         **({} if staleness is None else {"staleness": staleness}),
                         **({} if deterministic is None else {"deterministic": deterministic}))
        expect_ok(only(r), peer(0))
        if opt is not None:
            self.set_optimizer(opt)
        if init:
            self.init(init)

    def send(self, src, op, chunks=None, arrays=(), *, who=None, **fields):
        """Send one request from worker ``src``; return (its id, the replies now ready)."""
        req_id = next(self._ids)
        header = {"op": op, "id": req_id, "src": src, **fields}
        if chunks is not None:
            header["chunks"] = [list(c) for c in chunks]
        return req_id, self.state.handle(peer(src) if who is None else who, header, list(arrays))

    def raw(self, src, header, arrays=()):
        """Send a hand-made header (malformed requests); return its replies."""
        return self.state.handle(peer(src), header, list(arrays))

    def init(self, values: dict, src=0):
        rid, r = self.send(src, ops.INIT, list(values), [np.asarray(v) for v in values.values()])
        expect_ok(only(r), peer(src), rid)

    def set_optimizer(self, opt, src=0):
        rid, r = self.send(src, ops.SET_OPTIMIZER, optimizer=opt.to_config())
        expect_ok(only(r), peer(src), rid)

    def push(self, src, grads: dict, op=ops.PUSH):
        return self.send(src, op, list(grads), [np.asarray(g) for g in grads.values()])

    def pull(self, src, chunks):
        return self.send(src, ops.PULL, list(chunks))

    def value(self, cid, src=0):
        """The stored value, read by a pull that must be answered at once, as a host
        copy: a device backend's sync reply holds its device value, which the I/O
        loop's data plane downloads (or sends by reference) when it sends the reply."""
        rid, r = self.pull(src, [cid])
        rep = only(r)
        expect_ok(rep, peer(src), rid)
        return self.state.backend.download(rep.arrays[:1], copy=True)[0]


def only(replies):
    assert len(replies) == 1, replies
    assert isinstance(replies[0], Reply)
    return replies[0]


def expect_ok(reply, to, req_id=None, nvalues=None):
    assert reply.header["op"] == ops.OK, reply.header
    assert reply.peer == to
    if req_id is not None:
        assert reply.header["id"] == req_id
    if nvalues is not None:
        assert len(reply.arrays) == nvalues
    return reply


def expect_error(reply, to, req_id, kind, *fragments):
    h = reply.header
    assert h["op"] == ops.ERROR, h
    assert reply.peer == to and h["id"] == req_id
    assert h["kind"] == kind, h
    assert reply.arrays == []
    for f in fragments:
        assert f in h["message"], (f, h["message"])
    return reply


def by_id(replies):
    out = {r.header["id"]: r for r in replies}
    assert len(out) == len(replies), "two replies for one request"
    return out


def sgd(**kw):
    return optimizer.SGD(**{"learning_rate": 1.0, **kw})

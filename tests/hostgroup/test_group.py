"""kvstore.hostgroup.group on its own: each worker's :class:`HostGroup` made, registered
and formed the way DistStore does it (its advert is the worker's registered address,
``form`` reads the registration), its store's side the real
:class:`~kvstore.worker.exchange.Exchange` of a real :class:`~kvstore.worker.client.Client`
(``join_host``), against an in-process job (tests/cluster.py: scheduler and
ServerNode, ZeroMQ on 127.0.0.1). Whole jobs on emulated hosts:
tests/api/test_host_reduce.py.

Pinned from its docstring: workers whose host identities match form a group led by
the lowest rank, the others (alone on their host) push directly and their group is
closed; the leader sums the members' gradients with its own and pushes the host's
sum once, naming the workers it speaks for, and hands the pulled values back to
every member; members whose calls differ from the leader's all get an
InvalidArgumentError naming them and nothing is pushed; a member says bye at
close and the leader waits for every member's.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.modes import SYNC
from kvstore.protocol import ops
from kvstore.sharding import Placement
from kvstore.hostgroup.group import HostGroup
from kvstore.worker.arguments import KeyInfo
from kvstore.worker.client import Client
from kvstore.worker.exchange import Exchange, Wire
from kvstore.worker.job import JobMember

pytestmark = pytest.mark.timeout(60)

F32 = np.float32


def each(fn, n: int, raising: bool = True) -> list:
    """``fn(rank)`` in one thread per rank; the results (an exception is re-raised, or
    with ``raising=False`` returned in its rank's place)."""
    out: list = [None] * n
    errors: list = []

    def run(rank):
        try:
            out[rank] = fn(rank)
        except BaseException as e:      # handed to the test thread below
            out[rank] = e
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a worker hangs"
    if errors and raising:
        raise errors[0]
    return out


class Workers:
    """``n`` workers of one job, each with its HostGroup (``labels``: their host
    identities, KVSTORE_HOST_LABEL), registered with its advert, a Client and an
    Exchange; the servers configured in sync mode; ``formed``: what form() said."""

    def __init__(self, make_cluster, n: int, labels=None):
        self.cluster = cluster = make_cluster(n, 1, transport="tcp", data_channel=False, host_reduce=True)
        labels = labels or ["hostA"] * n
        self.configs = [cluster.config("worker", r).replace(host_label=labels[r]) for r in range(n)]
        self.groups = [HostGroup(c) for c in self.configs]
        self.members = [JobMember(c, addr=g.advert) for c, g in zip(self.configs, self.groups)]
        regs = each(lambda r: self.members[r].register(), n)
        self.clients = [Client(c, m.membership, reg.servers, reg.rank)
                        for c, m, reg in zip(self.configs, self.members, regs)]
        self.clients[0].request_all(ops.CONFIGURE, "configuring the servers", mode="sync", num_workers=n)
        self.formed = each(lambda r: self.groups[r].form(regs[r], self.members[r].membership), n)
        self.exchanges = [Exchange(client, config, SYNC, leads=lambda r=r: r == 0, wire=lambda: Wire())
                          for r, (client, config) in enumerate(zip(self.clients, self.configs))]
        for ok, exchange, group in zip(self.formed, self.exchanges, self.groups):
            if ok:
                exchange.join_host(group)
        self.placement = Placement(1, self.configs[0].chunk_bytes)

    def key(self, key, size: int, dtype=F32) -> KeyInfo:
        return KeyInfo(key, (size,), np.dtype(dtype), self.placement.place(key, size, np.dtype(dtype).itemsize))

    def close(self) -> None:
        """Leave as kvstore.worker.leaving does: flush, bye, finish, release."""
        def leave(rank):
            if self.formed[rank]:
                self.groups[rank].flush("close")
                self.groups[rank].leave("close")
            self.clients[rank].flush("close")
            self.members[rank].finish()
        try:
            each(leave, len(self.groups))
        finally:
            for group, client, member in zip(self.groups, self.clients, self.members):
                group.close()
                client.close()
                member.membership.close()


@pytest.fixture
def workers(make_cluster):
    made: list = []

    def make(n: int = 2, labels=None) -> Workers:
        w = Workers(make_cluster, n, labels)
        made.append(w)
        return w
    yield make
    for w in made:
        w.close()


def pushpull(w: Workers, rank: int, info: KeyInfo, grad) -> np.ndarray:
    out = np.full(info.size, np.nan, info.dtype)
    call = w.groups[rank].start(f"pushpull of {info.key!r}", [(info, np.asarray(grad, info.dtype))],
                                [(info, [out])])
    w.groups[rank].finish(call)
    return out


def test_workers_on_one_host_form_a_group_led_by_the_lowest_rank(workers):
    w = workers(3)
    assert w.formed == [True, True, True]
    assert [g.ranks for g in w.groups] == [(0, 1, 2)] * 3
    assert [g.leader for g in w.groups] == [0, 0, 0] and [g.leads for g in w.groups] == [True, False, False]


def test_the_leader_pushes_the_hosts_sum_once_and_every_member_gets_the_result(workers):
    w = workers(3)
    info = w.key("w", 1000)
    w.exchanges[0].init("init of w", [(info, np.zeros(info.size, F32))])
    grads = [np.full(info.size, 1 + r, F32) for r in range(3)]
    sent_before = [c.traffic.by_transport().get("tcp", {}).get("sent", 0) for c in w.clients]
    outs = each(lambda r: pushpull(w, r, info, grads[r]), 3)
    for out in outs:
        np.testing.assert_array_equal(out, 6)           # 1 + 2 + 3: the server's round counted all three
    sent = [c.traffic.by_transport().get("tcp", {}).get("sent", 0) - b for c, b in zip(w.clients, sent_before)]
    assert sent[0] >= info.size * 4 and sent[1:] == [0, 0]   # only the leader pushed
    assert w.groups[1].bytes_sent >= info.size * 4 and w.groups[2].bytes_sent >= info.size * 4
    outs = each(lambda r: pushpull(w, r, info, grads[2 - r]), 3)      # a second round, in call order
    for out in outs:
        np.testing.assert_array_equal(out, 6)


def test_a_member_whose_call_differs_fails_every_worker_of_the_group_and_nothing_is_pushed(workers):
    w = workers(2)
    a, b = w.key("a", 8), w.key("b", 8)
    w.exchanges[0].init("init", [(a, np.zeros(8, F32)), (b, np.zeros(8, F32))])
    before = w.clients[0].traffic.by_transport().get("tcp", {}).get("sent", 0)
    errors = each(lambda r: pushpull(w, r, [a, b][r], np.ones(8, F32)), 2, raising=False)
    for e in errors:
        assert isinstance(e, InvalidArgumentError), e
        assert "worker 1 (on this host) made a different call: it pushed 'b' (8 x float32)" in str(e)
        assert "where worker 0 pushed 'a' (8 x float32); nothing was sent" in str(e)
    assert str(errors[1]).endswith("(from worker 0, which sums this host's pushes)")
    assert w.clients[0].traffic.by_transport().get("tcp", {}).get("sent", 0) == before
    # the group goes on: the next call that agrees is summed
    outs = each(lambda r: pushpull(w, r, a, np.full(8, r + 1, F32)), 2)
    for out in outs:
        np.testing.assert_array_equal(out, 3)


def test_a_worker_alone_on_its_host_pushes_directly_and_its_group_is_closed(workers):
    w = workers(2, labels=["hostA", "hostB"])
    assert w.formed == [False, False]
    assert [g.ranks for g in w.groups] == [(0,), (1,)]
    w = workers(1)
    assert w.formed == [False]

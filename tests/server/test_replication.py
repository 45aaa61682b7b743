"""Replicated servers (KVSTORE_REPLICAS=1) in the state machine: a primary's
``replicate`` requests applied by a backup's state keep a replica equal to the
primary's values bit for bit after every round (and init); the backup refuses
rounds out of order or from a server it does not back up; the reply gate holds
replies until the backup acknowledged; a promoted replica serves re-sent pushes
without applying a round twice (dist_sync) or a push twice (dist_async, dist_ssp),
and a promoted dist_ssp replica reads with the dead primary's clocks. Real ServerStates, driven as the node drives them
(kvstore.server.replica_link carries the same requests over ZeroMQ; the failover of
a real job is tests/faults/test_replicated_servers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.protocol import ops
from kvstore.server.replication import AHEAD, ReplyGate, replicate_request
from kvstore.server.rounds import Reply
from kvstore.server.state import ServerState
from state_driver import A, B, Server, expect_error, expect_ok, only, peer

W = 3
F32 = np.float32
OPTIMIZERS = {
    "sgd-momentum-wd": optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3),
    "adam": optimizer.Adam(learning_rate=0.01),
    "none": None,
}


def pair(opt, deterministic=None):
    """Server 0 (primary, backed up by server 1) and server 1, both configured for
    W workers in sync mode (sums in arrival order unless ``deterministic``), with
    ``opt``; returns (primary, backup)."""
    primary, backup = (Server(num_workers=W, opt=opt, deterministic=deterministic) for _ in range(2))
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    return primary, backup


def forward(primary: Server, backup: Server, seq=[0]) -> None:
    """Hand what the primary's last event made it replicate to the backup, as the node does."""
    for fields, arrays in primary.state.replication.take():
        header = replicate_request(1000 + seq[0], 0, seq[0], fields)
        seq[0] += 1
        expect_ok(only(backup.state.handle(b"server 0", header, arrays)), b"server 0")


def replica(backup: Server, cid) -> np.ndarray:
    return backup.state.replicas.held[0][cid][0]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_backup_holds_the_primarys_values_bit_for_bit_after_every_round(name):
    primary, backup = pair(OPTIMIZERS[name])
    rng = np.random.default_rng(7)
    primary.init({A: rng.standard_normal(1000).astype(F32), B: rng.standard_normal(37).astype(F32)})
    forward(primary, backup)
    for cid in (A, B):
        assert replica(backup, cid).tobytes() == primary.state.chunks[cid].value.tobytes()
    for step in range(6):
        for w in (2, 0, 1):                                  # any arrival order
            _, replies = primary.push(w, {A: rng.standard_normal(1000).astype(F32),
                                          B: rng.standard_normal(37).astype(F32)})
            forward(primary, backup)
        for cid in (A, B):
            assert replica(backup, cid).tobytes() == primary.state.chunks[cid].value.tobytes(), (name, step, cid)
            assert backup.state.replicas.held[0][cid][1] == step + 1
    assert backup.state.chunks.keys().isdisjoint({A, B}), "a replica is the backup's own memory, not its chunks"


def test_the_backup_refuses_rounds_out_of_order_and_servers_it_does_not_back_up():
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    primary.init({A: np.zeros(4, F32)})
    forward(primary, backup)
    before = replica(backup, A).copy()
    fields = {"kind": "rounds", "chunks": [list(A)], "rounds": [2], "updated": True}
    expect_error(only(backup.state.handle(b"p", replicate_request(5, 0, 1, fields), [np.ones(4, F32)])),
                 b"p", 5, "InvalidArgumentError", "round 2", "next round is 1")
    expect_error(only(backup.state.handle(b"p", replicate_request(6, 2, 0, {**fields, "rounds": [1]}),
                                          [np.ones(4, F32)])),
                 b"p", 6, "InvalidArgumentError", "no replica for server 2")
    expect_error(only(backup.state.handle(b"p", replicate_request(7, 0, 2, {**fields, "rounds": [1]}),
                                          [np.ones(5, F32)])),
                 b"p", 7, "InvalidArgumentError", "round 1")
    assert replica(backup, A).tobytes() == before.tobytes()


def test_the_gate_holds_replies_until_every_earlier_replicate_is_acknowledged():
    gate = ReplyGate()
    value = np.arange(3, dtype=F32)
    assert gate.hold([Reply(b"a", {"id": 1})]) == [Reply(b"a", {"id": 1})]     # nothing out: passes
    gate.sent(10)
    held = gate.hold([Reply(b"a", {"id": 2}, [value])])
    gate.sent(11)
    assert held == [] and gate.hold([Reply(b"b", {"id": 3})]) == []
    value[:] = -1                                  # a later round changes the value: the held reply kept its own
    assert gate.acknowledged(11) == []             # 10 still out: nothing may pass it
    out = gate.acknowledged(10)
    assert [r.header["id"] for r in out] == [2, 3] and out[0].arrays[0].tolist() == [0, 1, 2]
    gate.sent(12)
    assert gate.hold([Reply(b"c", {"id": 4})]) == []
    assert [r.header["id"] for r in gate.open()] == [4]   # the backup died: everything leaves


def test_a_rounds_replies_leave_at_once_naming_the_replicate_they_wait_for_and_durable_counts_acks():
    gate = ReplyGate()
    assert gate.durable == -1 and gate.early([Reply(b"a", {"id": 1})]) == [Reply(b"a", {"id": 1})]
    gate.sent(1)
    gate.sent(2)
    out = gate.early([Reply(b"a", {"id": 2}), Reply(b"b", {"id": 3})])   # not held: each names 2
    assert [(r.peer, r.header) for r in out] == [(b"a", {"id": 2, "ticket": 2}), (b"b", {"id": 3, "ticket": 2})]
    assert gate.durable == 0 and gate.hold([Reply(b"c", {"id": 4})]) == []   # others still wait
    assert gate.acknowledged(2) == [] and gate.durable == 0     # 1 is still out: 2 is not durable yet
    assert [r.header["id"] for r in gate.acknowledged(1)] == [4] and gate.durable == 2
    gate.sent(3)
    gate.sent(4)
    assert gate.forget([3]) == [] and gate.durable == 3          # a gone backup's request counts as done
    assert gate.open() == [] and gate.durable == 4


def test_past_ahead_unacknowledged_replicates_a_rounds_replies_wait_for_the_backup_again():
    gate = ReplyGate()
    for seq in range(1, AHEAD + 1):
        gate.sent(seq)
    assert gate.early([Reply(b"a", {"id": 1})])[0].header["ticket"] == AHEAD     # AHEAD out: still early
    gate.sent(AHEAD + 1)
    assert gate.early([Reply(b"a", {"id": 2})]) == []                            # one more: held
    released = []
    for seq in range(1, AHEAD + 2):
        released += gate.acknowledged(seq)
    assert [r.header for r in released] == [{"id": 2}]


def test_a_promoted_replica_applies_no_round_twice_and_completes_the_open_one():
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    primary.init({A: np.linspace(0, 1, 8, dtype=F32)})
    forward(primary, backup)
    grads = {w: np.full(8, w + 1, F32) for w in range(W)}
    for w in range(W):                        # round 1, complete and replicated
        primary.send(w, ops.PUSH, [A], [grads[w]], rounds=[1])
        forward(primary, backup)
    for w in (0, 1):                          # round 2: open when the primary dies
        primary.send(w, ops.PUSH, [A], [grads[w]], rounds=[2])
    after_round_1 = primary.state.chunks[A].value.copy()
    backup.state.promote(0)                   # the scheduler promoted the backup
    assert backup.state.chunks[A].value.tobytes() == after_round_1.tobytes()
    # worker 2's round-1 push was not answered before the primary died: sent again, not applied again
    rid, r = backup.send(2, ops.PUSHPULL, [A], [grads[2]], rounds=[1])
    assert expect_ok(only(r), peer(2), rid).arrays[0].tobytes() == after_round_1.tobytes()
    # round 2 again from workers 0 and 1, then worker 2's: applied once, as the primary would have
    for w in (0, 1):
        assert backup.send(w, ops.PUSH, [A], [grads[w]], rounds=[2])[1] == []
    _, replies = backup.send(2, ops.PUSH, [A], [grads[2]], rounds=[2])
    assert len(replies) == 3 and all(r.header["op"] == ops.OK for r in replies)
    _, replies = primary.send(2, ops.PUSH, [A], [grads[2]], rounds=[2])     # the uninterrupted reference
    assert backup.state.chunks[A].value.tobytes() == primary.state.chunks[A].value.tobytes()
    rid, r = backup.send(0, ops.PUSH, [A], [grads[0]], rounds=[4])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "round 4", "next round", "is 3")


@pytest.mark.parametrize("name", ["adam", "sgd-momentum-wd"])
def test_rounds_answered_before_their_replicate_reached_the_backup_are_rebuilt_from_the_kept_pushes(name):
    """Replies leave ahead of the backup (ReplyGate.early): the primary answered
    rounds 2 and 3, their replicates were lost with it, and round 4 was open. The
    workers send again every push they still keep (2, 3, 4, in order), in any
    order across workers: the promoted replica reaches the primary's bits, and its
    next round is the job's next (deterministic sums: the same bits whatever the
    pushes' order)."""
    primary, backup = pair(OPTIMIZERS[name], deterministic=True)
    rng = np.random.default_rng(3)
    primary.init({A: rng.standard_normal(64).astype(F32)})
    forward(primary, backup)
    grads = {(w, n): rng.standard_normal(64).astype(F32) for w in range(W) for n in range(1, 5)}
    for w in range(W):                                    # round 1: on the backup
        primary.send(w, ops.PUSH, [A], [grads[w, 1]], rounds=[1])
        forward(primary, backup)
    for n in (2, 3):                                      # answered, their replicates never sent
        for w in range(W):
            primary.send(w, ops.PUSHPULL, [A], [grads[w, n]], rounds=[n])
        primary.state.replication.take()
    for w in (1, 2):                                      # round 4: open when the primary dies
        primary.send(w, ops.PUSH, [A], [grads[w, 4]], rounds=[4])
    backup.state.promote(0)
    for w in (2, 0, 1):
        for n in (2, 3):
            backup.send(w, ops.PUSHPULL, [A], [grads[w, n]], rounds=[n])
    for w in (1, 2, 0):
        backup.send(w, ops.PUSH, [A], [grads[w, 4]], rounds=[4])
    primary.send(0, ops.PUSH, [A], [grads[0, 4]], rounds=[4])    # the uninterrupted reference
    assert backup.state.chunks[A].value.tobytes() == primary.state.chunks[A].value.tobytes()
    rid, r = backup.send(0, ops.PUSH, [A], [grads[0, 4]], rounds=[6])
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "round 6", "is 5")


def test_layerwise_pushes_are_refused_with_a_backup():
    primary, _ = pair(optimizer.LAMB(learning_rate=0.01))
    primary.init({A: np.zeros(4, F32)})
    rid, r = primary.send(0, ops.PUSH, [A], [np.ones(4, F32)], norms=True)
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "not replicated yet", "KVSTORE_REPLICAS")


def test_an_init_sent_again_to_the_promoted_backup_keeps_the_replicas_value():
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    primary.init({A: np.ones(4, F32)})
    forward(primary, backup)
    for w in range(W):
        primary.send(w, ops.PUSH, [A], [np.full(4, 2, F32)], rounds=[1])
        forward(primary, backup)
    backup.state.promote(0)
    value = backup.state.chunks[A].value.copy()
    rid, r = backup.send(0, ops.INIT, [A, B], [np.ones(4, F32), np.zeros(3, F32)])   # its reply was lost
    expect_ok(only(r), peer(0), rid)
    assert backup.state.chunks[A].value.tobytes() == value.tobytes() and B in backup.state.chunks
    rid, r = backup.send(0, ops.INIT, [A], [np.ones(4, F32)])                        # a second one is an error
    expect_error(only(r), peer(0), rid, "InvalidArgumentError", "already initialised")


def states_of(server: Server, cids) -> list[tuple]:
    """(t, state bytes) of each chunk's optimizer rank on ``server`` (own chunks and replicas alike)."""
    got = server.state.updater.get_states()
    return [(int(got[c]["t"]), [np.asarray(a).tobytes() for a in got[c]["state"]]) for c in cids]


def test_loaded_optimizer_states_reach_the_replicas_bit_for_bit_and_a_promoted_one_goes_on_as_the_primary():
    primary, backup = pair(optimizer.Adam(learning_rate=0.01, wd=1e-3))
    rng = np.random.default_rng(11)
    primary.init({A: rng.standard_normal(6).astype(F32), B: rng.standard_normal(5).astype(F32)})
    forward(primary, backup)

    def round_(number):
        for w in range(W):
            primary.send(w, ops.PUSH, [A, B], [rng.standard_normal(6).astype(F32),
                                               rng.standard_normal(5).astype(F32)], rounds=[number, number])
            forward(primary, backup)
    round_(1)
    round_(2)
    # load_optimizer_states: a state unlike the one the rounds made (t 7, moments of our own)
    loaded = [rng.standard_normal(n).astype(F32) for n in (6, 6, 5, 5)]
    loaded[1], loaded[3] = np.abs(loaded[1]), np.abs(loaded[3])       # Adam's second moments
    rid, r = primary.send(0, ops.SET_STATES, states=[["w", 0, 7, 2], ["w", 1, 3, 2]], arrays=loaded)
    expect_ok(only(r), peer(0), rid)
    forward(primary, backup)
    want = [(7, [loaded[0].tobytes(), loaded[1].tobytes()]), (3, [loaded[2].tobytes(), loaded[3].tobytes()])]
    assert states_of(primary, [A, B]) == want and states_of(backup, [A, B]) == want
    round_(3)
    for cid in (A, B):
        assert replica(backup, cid).tobytes() == primary.state.chunks[cid].value.tobytes()
    assert states_of(backup, [A, B]) == states_of(primary, [A, B])
    backup.state.promote(0)                   # the primary died: the promoted replica's next round is the primary's
    grads = [(rng.standard_normal(6).astype(F32), rng.standard_normal(5).astype(F32)) for _ in range(W)]
    for server in (primary, backup):
        for w in range(W):
            server.send(w, ops.PUSH, [A, B], list(grads[w]), rounds=[4, 4])
    for cid in (A, B):
        assert backup.state.chunks[cid].value.tobytes() == primary.state.chunks[cid].value.tobytes()


def test_a_backup_refuses_states_for_chunks_it_holds_no_replica_of():
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    primary.init({A: np.ones(4, F32)})
    forward(primary, backup)
    fields = {"kind": "states", "states": [["w", 1, 1, 1]]}
    expect_error(only(backup.state.handle(b"p", replicate_request(9, 0, 1, fields), [np.zeros(4, F32)])),
                 b"p", 9, "InvalidArgumentError", "no replica of", "server 0")


def test_a_request_routed_by_a_newer_book_waits_with_those_after_it_until_the_server_holds_it():
    import zmq

    from kvstore.config import Config
    from kvstore.server.replica_link import ReplicaLink
    from tracker.control.membership import ServersBook
    ctx = zmq.Context()
    server = Server(num_workers=W)
    link = ReplicaLink(Config(timeout=5.0), ctx, 2, ["tcp://127.0.0.1:9"] * 3, server.state)
    try:
        link.book(ServersBook(0, (0, 1, 2), (1, 2, 0)))
        first = {"op": ops.PULL, "id": 1, "src": 0, "chunks": [list(A)], "book": 1}
        second = {"op": ops.PULL, "id": 2, "src": 1, "chunks": [list(B)]}        # no book: waits behind it
        assert link.waits(b"w0", first, [], now=0.0) and link.waits(b"w1", second, [], now=0.1)
        assert link.ready(now=1.0) == ([], [])
        link.book(ServersBook(1, (0, 2, 2), (None, None, 0)))                      # server 1 died
        ready, late = link.ready(now=1.2)
        assert [h["id"] for _, h, _ in ready] == [1, 2] and late == []
        assert link.promoted == [1] and not link.waits(b"w0", second, [], now=1.3)
        stale = {"op": ops.PULL, "id": 3, "src": 0, "chunks": [list(A)], "book": 2}  # never comes
        assert link.waits(b"w0", stale, [], now=2.0)
        assert link.ready(now=6.9) == ([], [])
        ready, late = link.ready(now=7.1)
        assert ready == [] and expect_error(only(late), b"w0", 3, "DeadlineError", "book epoch 2", "KVSTORE_TIMEOUT")
    finally:
        link.close()
        ctx.term()


def async_pair():
    opt = optimizer.SGD(learning_rate=0.5, momentum=0.9)
    primary, backup = Server(mode="async", num_workers=W, opt=opt), Server(mode="async", num_workers=W, opt=opt)
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    return primary, backup


def test_dist_async_replicas_follow_every_push_and_a_promoted_one_applies_none_twice():
    primary, backup = async_pair()
    primary.init({A: np.linspace(-1, 1, 16, dtype=F32)})
    forward(primary, backup)
    rng = np.random.default_rng(3)
    numbers = {w: 0 for w in range(W)}
    sent = []
    for w in (0, 2, 2, 1, 0, 1, 2):            # any order, several pushes of a worker in a row
        numbers[w] += 1
        grad = rng.standard_normal(16).astype(F32)
        sent.append((w, numbers[w], grad))
        expect_ok(only(primary.send(w, ops.PUSH, [A], [grad], rounds=[numbers[w]])[1]), peer(w))
        forward(primary, backup)
        assert replica(backup, A).tobytes() == primary.state.chunks[A].value.tobytes()
    assert backup.state.replicas.held[0][A][2] == {0: 2, 1: 2, 2: 3}
    backup.state.promote(0)
    before = backup.state.chunks[A].value.copy()
    for w, n, grad in sent[-3:]:              # their acknowledgements were lost: sent again, not applied
        expect_ok(only(backup.send(w, ops.PUSHPULL, [A], [grad], rounds=[n])[1]), peer(w))
    assert backup.state.chunks[A].value.tobytes() == before.tobytes()
    grad = rng.standard_normal(16).astype(F32)     # worker 0's next push is applied, once
    for state in (backup, primary):
        expect_ok(only(state.send(0, ops.PUSH, [A], [grad], rounds=[3])[1]), peer(0))
    assert backup.state.chunks[A].value.tobytes() == primary.state.chunks[A].value.tobytes()
    rid, r = backup.send(1, ops.PUSH, [A], [grad], rounds=[5])
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "push 5", "last one applied", "is 2")


def ssp_pair(bound: int):
    """Primary and backup in dist_ssp (staleness ``bound``), SGD(learning_rate=1):
    integer pushes keep exact sums."""
    opt = optimizer.SGD(learning_rate=1.0)
    primary, backup = (Server(mode="ssp", num_workers=W, opt=opt, staleness=bound) for _ in range(2))
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    return primary, backup


def test_dist_ssp_replicas_carry_every_workers_clock_and_a_promoted_one_holds_reads_as_the_primary_did():
    """Each replicated push advances the replica's clock of its worker (its last push
    number applied); promoted, the backup's clocks are the primary's: a pushpull sent
    again whose push was applied is not applied or counted twice and its read waits
    exactly as on the primary, and the pushes that release it there release it here
    (with clocks at 0 it would be answered at once: that is what this test catches)."""
    primary, backup = ssp_pair(1)
    primary.init({A: np.zeros(4, F32)})
    forward(primary, backup)

    def push(server, w, number, op=ops.PUSH):        # worker w's pushes are 10 ** w each
        return server.send(w, op, [A], [np.full(4, 10 ** w, F32)], rounds=[number])
    for w, number in ((0, 1), (1, 1), (2, 1), (0, 2)):
        expect_ok(only(push(primary, w, number)[1]), peer(w))
        forward(primary, backup)
    parked, r = push(primary, 0, 3, ops.PUSHPULL)   # worker 0 at clock 3, the others at 1: bound 1 holds it
    forward(primary, backup)
    assert r == [] and primary.state.consistency.clock(A) == [3, 1, 1]
    assert backup.state.replicas.held[0][A][2] == {0: 3, 1: 1, 2: 1}
    backup.state.promote(0)                          # the primary died with worker 0's read parked
    assert backup.state.consistency.clock(A) == [3, 1, 1]
    assert backup.state.chunks[A].value.tolist() == primary.state.chunks[A].value.tolist() == [-113.0] * 4
    again, r = push(backup, 0, 3, ops.PUSHPULL)      # sent again: applied already, so only its read
    assert r == [] and backup.state.chunks[A].value.tolist() == [-113.0] * 4
    assert backup.state.consistency.clock(A) == [3, 1, 1]
    for server, read in ((primary, parked), (backup, again)):
        expect_ok(only(push(server, 1, 2)[1]), peer(1))     # worker 1 catches up: 2 < 3 - 1 no more, but
        ok, released = push(server, 2, 2)[1]                # the read waits for worker 2 too, released here
        expect_ok(ok, peer(2))
        assert released.header["id"] == read and released.arrays[0].tolist() == [-223.0] * 4
    assert backup.state.chunks[A].value.tobytes() == primary.state.chunks[A].value.tobytes()
    rid, r = backup.send(1, ops.PUSH, [A], [np.ones(4, F32)], rounds=[5])
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "push 5", "last one applied", "is 2")


def test_a_restored_dist_ssp_primary_and_its_replicas_start_every_clock_at_0():
    """A resume starts every clock at 0 (the checkpoint holds values, not clocks) on the
    primary and on the replicas its restore rebuilds: promoted, the backup reads with
    the clocks the resumed workers count from."""
    primary, backup = ssp_pair(2)
    primary.init({A: np.zeros(4, F32)})
    forward(primary, backup)
    for n in (1, 2):
        for w in range(W):
            primary.send(w, ops.PUSH, [A], [np.ones(4, F32)], rounds=[n])
            forward(primary, backup)
    snap = primary.state.snapshot({"step": 2})
    restored, fresh_backup = ssp_pair(2)
    restored.state.restore(snap)
    rid, r = restored.send(0, ops.CONFIGURE, mode="ssp", num_workers=W, staleness=2)
    expect_ok(only(r), peer(0), rid)
    forward(restored, fresh_backup)
    assert fresh_backup.state.replicas.held[0][A][1:3] == [0, {}]
    assert restored.state.consistency.clock(A) == [0] * W
    expect_ok(only(restored.send(0, ops.PUSH, [A], [np.ones(4, F32)], rounds=[1])[1]), peer(0))
    forward(restored, fresh_backup)
    fresh_backup.state.promote(0)
    assert fresh_backup.state.consistency.clock(A) == [1, 0, 0]
    assert fresh_backup.state.chunks[A].value.tolist() == restored.state.chunks[A].value.tolist() == [-7.0] * 4


U = ("u", 0)        # a chunk of the backup's own share


def saved(snapshot: dict) -> list[tuple]:
    return sorted((c[0], c[1]) for c in snapshot["chunks"])


def test_a_snapshot_holds_own_chunks_never_replicas_and_a_promoted_share_is_its_dead_servers_part():
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    primary.init({A: np.ones(4, F32)})
    forward(primary, backup)
    backup.init({U: np.zeros(3, F32)})                 # the backup's own share
    assert saved(backup.state.snapshot({})) == [U]     # the replica of A is server 0's to save
    backup.state.promote(0)
    rid, r = backup.send(1, ops.INIT, [B], [np.full(5, 2, F32)], share=0)   # server 0's share, after its death
    expect_ok(only(r), peer(1), rid)
    assert saved(backup.state.snapshot({})) == [U]
    assert saved(backup.state.snapshot({}, share=0)) == [A, B]
    assert backup.state.replication.take() == []       # the dead server's chunks have no backup now
    rid, r = backup.send(1, ops.INIT, [("x", 0)], [np.ones(2, F32)], share=2)
    expect_error(only(r), peer(1), rid, "InvalidArgumentError", "server 2's share", "does not serve it")


def test_a_restored_primary_rebuilds_its_backups_replicas_with_their_optimizer_state():
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    primary.init({A: np.linspace(0, 1, 6, dtype=F32)})
    forward(primary, backup)
    for w in range(W):
        primary.send(w, ops.PUSH, [A], [np.full(6, w + 1, F32)], rounds=[1])
        forward(primary, backup)
    snap = primary.state.snapshot({"step": 1})
    restored, fresh_backup = pair(OPTIMIZERS["sgd-momentum-wd"])   # the resumed job's servers
    restored.state.restore(snap)
    fresh_backup.state.restore(backup.state.snapshot({"step": 1}))
    forward(restored, fresh_backup)                    # the rebuild goes with the primary's next event
    assert replica(fresh_backup, A).tobytes() == restored.state.chunks[A].value.tobytes()
    assert states_of(fresh_backup, [A]) == states_of(restored, [A]) == states_of(primary, [A])


E = ["e", 1]          # row table "e", server 1's shard of 2
I64 = np.int64


def test_row_sparse_rounds_and_assignments_keep_the_replica_equal_and_a_promoted_one_applies_none_twice():
    primary, backup = pair(optimizer.Adam(learning_rate=0.05))
    cid = ("e", 1)
    expect_ok(only(primary.send(0, ops.INIT_ROWS, arrays=[np.array([1, 5], I64), np.ones(6, F32)], chunk=E,
                                shape=[10, 3], dtype="float32", servers=2,
                                init={"kind": "normal", "scale": 0.1, "shape": [10, 3], "seed": 2,
                                      "dtype": "float32"})[1]), peer(0))
    forward(primary, backup)
    assert replica(backup, cid).tobytes() == primary.state.chunks[cid].value.tobytes()
    rng = np.random.default_rng(4)

    def round_(number, server=primary, send=True):
        for w in range(W):
            rows = np.array(sorted({1 + 2 * int(r) for r in rng.integers(0, 5, 2)}), I64)   # this shard's rows
            server.send(w, ops.PUSH_ROWS, arrays=[rows, rng.standard_normal(3 * len(rows)).astype(F32)],
                        chunk=E, rounds=[number])
            if send:
                forward(primary, backup)
    round_(1)
    expect_ok(only(primary.send(0, ops.SET_ROWS, arrays=[np.array([3], I64), np.full(3, 7, F32)], chunk=E)[1]),
              peer(0))
    forward(primary, backup)
    round_(2)
    assert replica(backup, cid).tobytes() == primary.state.chunks[cid].value.tobytes()
    assert states_of(backup, [cid]) == states_of(primary, [cid])
    backup.state.promote(0)
    rid, r = backup.send(0, ops.PUSH_ROWS, arrays=[np.array([1], I64), np.ones(3, F32)], chunk=E, rounds=[2])
    expect_ok(only(r), peer(0), rid)                 # round 2 applied already: not again
    assert backup.state.chunks[cid].value.tobytes() == primary.state.chunks[cid].value.tobytes()
    pushes = [(w, np.array([3, 7], I64), rng.standard_normal(6).astype(F32)) for w in range(W)]
    for server in (primary, backup):                 # round 3 on both: the same bits
        for w, rows, data in pushes:
            server.send(w, ops.PUSH_ROWS, arrays=[rows, data], chunk=E, rounds=[3])
    assert backup.state.chunks[cid].value.tobytes() == primary.state.chunks[cid].value.tobytes()
    rid, r = backup.send(1, ops.PULL_ROWS, arrays=[np.array([3, 7], I64)], chunk=E)
    assert expect_ok(only(r), peer(1), rid).arrays[0].tobytes() == \
        primary.state.chunks[cid].value.reshape(5, 3)[[1, 3]].tobytes()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_row_sparse_push_on_a_dense_key_is_updated_lazily_on_the_replica_too(mode):
    from kvstore.rows import lazy
    opt = optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)     # lazy: weight decay on named rows only
    primary, backup = Server(mode=mode, num_workers=W, opt=opt), Server(mode=mode, num_workers=W, opt=opt)
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    primary.init({A: np.linspace(-1, 1, 12, dtype=F32)})       # 4 rows of 3
    forward(primary, backup)
    for number in (1, 2):
        for w in range(W):
            named = np.array([w % 4, (w + number) % 4], I64) if w != 1 else np.array([2], I64)
            grad = np.zeros(12, F32)
            for r in named:
                grad[3 * r:3 * r + 3] = w + number
            primary.send(w, ops.PUSH, [A], [grad], rounds=[number],
                         rows=[lazy.chunk_field(np.unique(named), 3, 0, 12)])
            forward(primary, backup)
    assert replica(backup, A).tobytes() == primary.state.chunks[A].value.tobytes()
    assert states_of(backup, [A]) == states_of(primary, [A])


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_replacement_rebuilt_mid_job_holds_the_primarys_bits_and_round_counts_from_then_on(mode):
    """--restart-servers: a replacement (an unconfigured server) becomes the backup of
    the primary's own share and of a dead server's share the primary serves; the
    rebuild (setup, values with their round counts, optimizer state) then later
    rounds keep its replicas equal bit for bit, and promoted it applies no round
    (dist_sync) or push (dist_async, dist_ssp) twice; dist_ssp's clocks go on from
    the pushes counted."""
    opt = optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3)
    bound = 2 if mode == "ssp" else None                # (dist_ssp: the setup carries the bound)
    primary, old = (Server(mode=mode, num_workers=W, opt=opt, staleness=bound) for _ in range(2))
    primary.state.replication.backup = 1
    old.state.replicas.primaries = frozenset({0})
    rng = np.random.default_rng(11)
    primary.init({A: rng.standard_normal(40).astype(F32)})
    forward(primary, old)
    numbers = {w: 0 for w in range(W)}

    def step(server: Server, backup: Server | None, deliver=None):
        for w in range(W):
            numbers[w] += 1
            server.send(w, ops.PUSH, [A], [rng.standard_normal(40).astype(F32)], rounds=[numbers[w]])
            if backup is not None:
                forward(server, backup)
            if deliver is not None:            # each event's replicate requests, as the node sends them
                deliver()
    for _ in range(3):
        step(primary, old)
    old.state.promote(0)                         # server 0 died: "old" serves share 0 without a backup
    old.state.replication.backup = None
    step(old, None)
    expect_ok(only(old.send(1, ops.INIT, [B], [np.full(9, 0.5, F32)], share=0)[1]), peer(1))
    step(old, None)
    new = Server.__new__(Server)                 # the replacement: never configured by a worker
    new.state, new._ids = ServerState(name="server 2"), iter(range(10 ** 6))
    new.state.replicas.primaries = frozenset({0})
    old.state.replication.backups = {0: 2}       # the replacement backs up share 0, served by "old"
    assert old.state.rebuild(0) == 2
    fields = [f for f, _ in old.state.replication.take()]
    assert [f["kind"] for f in fields] == ["setup", "init", "states"] and all(f["share"] == 0 for f in fields)
    old.state.rebuild(0)
    for f, arrays in old.state.replication.take():
        expect_ok(only(new.state.handle(b"s1", replicate_request(5, 1, 0, f), arrays)), b"s1")
    assert new.state.mode is not None and new.state.updater is not None
    held = new.state.replicas.held[0]
    assert held[A][1] == 5 * (1 if mode == "sync" else W)       # the rounds (pushes) applied before
    assert new.state.consistency is not None and new.state.consistency.bound == bound
    def deliver():
        for f, arrays in old.state.replication.take():
            expect_ok(only(new.state.handle(b"s1", replicate_request(6, 1, 1, f), arrays)), b"s1")
    for _ in range(2):
        step(old, None, deliver)
        for cid in (A, B):
            assert held[cid][0].tobytes() == old.state.chunks[cid].value.tobytes(), (mode, cid)
    assert states_of(new, [A]) == states_of(old, [A])
    new.state.promote(0)
    before = new.state.chunks[A].value.copy()
    for w in range(W):                           # the last step's pushes sent again: not applied twice
        expect_ok(only(new.state.handle(peer(w), {"op": ops.PUSH, "id": 99, "src": w, "chunks": [list(A)],
                                                  "rounds": [numbers[w]]}, [np.ones(40, F32)])), peer(w))
    assert new.state.chunks[A].value.tobytes() == before.tobytes()
    if mode == "ssp":                            # its clocks: every worker's pushes, counted once
        assert new.state.consistency.clock(A) == [numbers[w] for w in range(W)] == [7] * W


def test_a_setup_that_disagrees_with_the_replicas_held_is_refused():
    primary = Server(num_workers=W, opt=optimizer.SGD(learning_rate=0.1))
    primary.init({A: np.ones(4, F32)})
    primary.state.replication.backup = 2
    primary.state.rebuild(None)
    other = Server(mode="async", num_workers=W, opt=optimizer.SGD(learning_rate=0.1))
    other.state.replicas.primaries = frozenset({0})
    setup, _ = primary.state.replication.take()[0]
    expect_error(only(other.state.handle(b"s0", replicate_request(1, 0, 0, setup), [])), b"s0", 1,
                 "InvalidArgumentError", "runs dist_async", "replicates dist_sync")


def test_a_numbered_set_optimizer_reaches_a_replacement_through_its_primaries_and_is_applied_once():
    """A backup that is a replacement hears set_optimizer from no worker: each primary
    forwards the numbered call; one that hears it twice (two primaries, or from a
    worker too) applies it once (a state scale applied twice would halve it twice)."""
    sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9)
    primary = Server(num_workers=W, opt=sgd)
    primary.init({A: np.linspace(-1, 1, 8, dtype=F32)})
    for w in range(W):
        primary.send(w, ops.PUSH, [A], [np.full(8, w + 1.0, F32)])
    primary.state.replication.backup = 2
    primary.state.rebuild(None)
    replacement = Server.__new__(Server)
    replacement.state = ServerState(name="server 2")
    replacement.state.replicas.primaries = frozenset({0})
    for seq, (f, arrays) in enumerate(primary.state.replication.take()):
        expect_ok(only(replacement.state.handle(b"s0", replicate_request(seq + 1, 0, seq, f), arrays)), b"s0")
    slower = optimizer.SGD(learning_rate=0.05, momentum=0.9).to_config()
    rid, r = primary.send(0, ops.SET_OPTIMIZER, optimizer=slower, keep_state=True, state_scale=0.5, call=1)
    expect_ok(only(r), peer(0), rid)
    [(forwarded, _)] = primary.state.replication.take()
    assert forwarded["kind"] == "optimizer" and forwarded["caller"] == 0 and forwarded["call"] == 1
    for again in range(2):        # forwarded twice (two primaries): applied once
        expect_ok(only(replacement.state.handle(b"s0", replicate_request(10 + again, 0, 5 + again, forwarded), [])),
                  b"s0")
    expect_ok(only(replacement.state.handle(peer(0), {"op": ops.SET_OPTIMIZER, "id": 20, "src": 0, "optimizer": slower,
                                                      "keep_state": True, "state_scale": 0.5, "call": 1}, [])), peer(0))
    assert states_of(replacement, [A]) == states_of(primary, [A])
    assert replacement.state.optimizer.config() == primary.state.optimizer.config() == slower
    rid, r = primary.send(0, ops.SET_OPTIMIZER, optimizer=slower, call=0)
    expect_error(only(r), peer(0), rid, "ProtocolError", "'call'")


def members(servers, epoch: int, ranks) -> None:
    """The scheduler's members of an elastic job as every server hears them."""
    for server in servers:
        assert server.state.set_members(epoch, ranks) == []


def test_a_joiner_numbers_its_pushes_from_its_join_and_a_promoted_replica_knows_where_they_start():
    """Elastic jobs (kvstore.server.numbering): worker 2 leaves after round 1 and a new
    process joins in its rank after round 2, numbering its pushes from 1 again. The
    primary takes its push 1 as round 3; the backup learnt the same base at the join,
    so once promoted it takes the joiner's push 2 as round 4 and a re-sent push 1 as
    applied already. (Without the bases: "its next round ... is 3", then 4.)"""
    primary, backup = pair(OPTIMIZERS["sgd-momentum-wd"])
    reference = Server(num_workers=W, opt=OPTIMIZERS["sgd-momentum-wd"])     # the same rounds, no failover
    primary.init({A: np.linspace(0, 1, 8, dtype=F32)})
    reference.init({A: np.linspace(0, 1, 8, dtype=F32)})
    forward(primary, backup)
    grad = {w: np.full(8, w + 1, F32) for w in range(W)}

    def push(servers, worker, number, replicate=True):
        for server in servers:
            rid, r = server.send(worker, ops.PUSH, [A], [grad[worker]], rounds=[number])
            assert all(x.header["op"] == ops.OK for x in r), r
            if server is primary and replicate:
                forward(primary, backup)

    for w in range(W):
        push([primary, reference], w, 1)                  # round 1
    members([primary, backup, reference], 1, {0, 1})      # worker 2 left
    for w in (0, 1):
        push([primary, reference], w, 2)                  # round 2, without it
    members([primary, backup, reference], 2, {0, 1, 2})   # a new process joined in rank 2
    for w, number in ((0, 3), (1, 3), (2, 1)):
        push([primary, reference], w, number)             # round 3: the joiner's push 1
    push([primary, reference], 2, 2, replicate=False)     # round 4 opens: the primary dies
    backup.state.promote(0)
    rid, r = backup.send(2, ops.PUSHPULL, [A], [grad[2]], rounds=[1])    # a lost reply: sent again
    assert expect_ok(only(r), peer(2), rid).arrays[0].tobytes() == primary.state.chunks[A].value.tobytes()
    push([backup], 2, 2)                                  # round 4 on the promoted replica
    push([backup], 0, 4)
    push([backup, reference], 1, 4)
    push([reference], 0, 4)
    assert backup.state.chunks[A].value.tobytes() == reference.state.chunks[A].value.tobytes()
    rid, r = backup.send(2, ops.PUSH, [A], [grad[2]], rounds=[4])
    expect_error(only(r), peer(2), rid, "InvalidArgumentError", "worker 2 pushes its round 4",
                 "its next round", "is 3")


def test_in_dist_async_a_joiners_pushes_are_not_taken_for_its_predecessors():
    """dist_async: worker 1 pushed twice and left; a new process joins in rank 1 and
    pushes its push 1 and 2: applied (a predecessor's numbers would make them look
    applied already: lost), on the primary and on the promoted replica alike."""
    primary = Server(mode="async", num_workers=2, opt=optimizer.SGD(learning_rate=1.0))
    backup = Server(mode="async", num_workers=2, opt=optimizer.SGD(learning_rate=1.0))
    primary.state.replication.backup = 1
    backup.state.replicas.primaries = frozenset({0})
    primary.init({A: np.zeros(4, F32)})
    forward(primary, backup)
    ones = np.ones(4, F32)
    for number in (1, 2):
        primary.send(1, ops.PUSH, [A], [ones], rounds=[number])
        forward(primary, backup)
    members([primary, backup], 1, {0})
    members([primary, backup], 2, {0, 1})          # the new process
    primary.send(1, ops.PUSH, [A], [ones], rounds=[1])
    forward(primary, backup)
    assert primary.state.chunks[A].value.tolist() == [-3.0] * 4
    backup.state.promote(0)
    backup.send(1, ops.PUSH, [A], [ones], rounds=[1])          # sent again: applied already
    backup.send(1, ops.PUSH, [A], [ones], rounds=[2])
    assert backup.state.chunks[A].value.tolist() == [-4.0] * 4

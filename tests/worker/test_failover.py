"""kvstore.worker.failover on its own (pure: no sockets): :class:`Failover`, which the
client asks at every request and wait with replicated servers, and
:func:`replicated_config`, which :func:`kvstore.create` applies (whole jobs with a
server killed: tests/faults/test_replicated_servers.py).

Pinned from its docstring: every share starts on its own server and moves to the one
a newer servers' book names (an old or malformed book changes nothing), and the
servers that serve no share any more are the ones whose requests are sent again;
a push's ``rounds`` counts this worker's pushes of each chunk, other ops carry none;
a request is kept (without its ``seq``, buffers copied) until answered;
replicated_config turns off what cannot be sent again and refuses the rest naming
the setting.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.modes import ASYNC, SSP, SYNC
from kvstore.protocol import ops
from kvstore.worker.failover import Failover, replicated_config
from tracker.control.membership import ServersBook

pytestmark = pytest.mark.timeout(30)


def test_each_share_is_served_by_its_own_server_until_a_newer_book_moves_it():
    f = Failover(3)
    assert [f.route(s) for s in range(3)] == [0, 1, 2] and f.live() == [0, 1, 2] and f.epoch == 0
    assert f.moved(ServersBook(1, (0, 2, 2), (2, 0, 0))) == {1}               # server 1 died: 2 serves its share
    assert [f.route(s) for s in range(3)] == [0, 2, 2] and f.live() == [0, 2] and f.epoch == 1
    assert f.moved(ServersBook(1, (0, 0, 0), (1, 1, 1))) == set()             # not newer: ignored
    assert f.moved(ServersBook(2, (0, 0), (1, 1))) == set()                   # a book of another job's size: ignored
    assert [f.route(s) for s in range(3)] == [0, 2, 2] and f.epoch == 1
    assert f.moved(ServersBook(3, (0, 0, 0), (0, 0, 0))) == {2}
    assert f.live() == [0]


def test_a_push_is_numbered_per_chunk_and_other_ops_carry_no_rounds():
    f = Failover(2)
    assert f.number(ops.PUSH, [["w", 0], ["b", 1]]) == [1, 1]
    assert f.number(ops.PUSHPULL, [["w", 0]]) == [2]
    assert f.number(ops.PUSH_ROWS, [["e", 1]]) == [1]
    assert f.number(ops.PUSH_ROWS, [["e", 1]]) == [2]
    assert f.number(ops.PUSH, [("b", 1)]) == [2]                     # a chunk is its (key, index), tuple or list
    for op in (ops.PULL, ops.INIT, ops.PULL_ROWS, ops.WRITE):
        assert f.number(op, [["w", 0]]) is None
    assert f.number(ops.PUSH, []) is None
    assert f.number(ops.PUSH, [["w", 0]]) == [3]                     # the others did not count


def test_a_request_is_kept_with_its_own_buffers_until_answered():
    f = Failover(2)
    grad = np.ones(4, np.float32)
    owned = Failover.owned([grad])
    f.keep(7, 1, ops.PUSH, {"chunks": [["w", 1]], "seq": 3, "rounds": [1]}, owned)
    grad[:] = 5                                                       # the caller reuses its buffer
    share, op, fields, arrays = f.kept(7)
    assert (share, op, fields) == (1, ops.PUSH, {"chunks": [["w", 1]], "rounds": [1]})   # no seq: a new one is given
    np.testing.assert_array_equal(arrays[0], 1)
    f.answered(7)
    assert f.kept(7) is None
    f.answered(7)                                                     # twice: nothing to drop


def test_a_push_answered_ahead_of_its_backup_is_kept_until_its_server_says_it_is_durable():
    f = Failover(2)
    for req_id, op in ((1, ops.PUSHPULL), (2, ops.PUSH), (3, ops.PULL), (4, ops.PUSH)):
        f.keep(req_id, 1, op, {"chunks": [["w", 1]]}, [])
    f.keep(5, 1, ops.PUSH, {"chunks": [["w", 1]]}, [])
    f.answered(1, 1, {"op": "ok", "ticket": 5}, "pushpull of key 'w'")
    f.answered(2, 1, {"op": "ok", "ticket": 6}, "push of key 'w'")
    f.answered(3, 1, {"op": "ok", "ticket": 6}, "pull of key 'w'")     # a read: nothing to send again
    f.answered(4, 1, {"op": "ok"}, "push of key 'w'")                  # no ticket: durable already
    f.answered(5, 1, {"op": "error", "ticket": 6}, "push of key 'w'")  # refused: never sent again
    assert [f.kept(i) is not None for i in (1, 2, 3, 4, 5)] == [True, True, False, False, False]
    assert f.unsettled() == [1]
    f.durable(0, 9)                                 # another server's tickets: not these
    f.durable(1, "6")                               # not a number: ignored
    f.durable(1, 5)
    assert f.kept(1) is None and f.kept(2) is not None
    f.durable(1, 6)
    assert f.kept(2) is None and f.unsettled() == []


def test_the_pushes_a_dead_server_answered_ahead_of_its_backup_are_sent_again_and_kept_anew():
    f = Failover(3)
    f.keep(1, 1, ops.PUSH, {"chunks": [["w", 1]]}, [])
    f.keep(2, 2, ops.PUSH, {"chunks": [["w", 2]]}, [])
    f.answered(1, 1, {"op": "ok", "ticket": 4}, "push of key 'w'")
    f.answered(2, 2, {"op": "ok", "ticket": 4}, "push of key 'w'")
    assert f.unsettled() == [1, 2] and f.resent() == []
    assert f.unconfirmed({1}) == [(1, "push of key 'w'")] and f.unconfirmed({1}) == []
    assert f.kept(1) is not None and f.unsettled() == [2]     # kept: its new server answers it next
    assert f.resent() == [1]                                  # sent again, not answered yet
    f.durable(1, 9)                                           # the dead server's word no longer counts
    assert f.kept(1) is not None
    f.answered(1, 2, {"op": "ok", "ticket": 7}, "push of key 'w'")   # the new server answered it ahead of its backup
    assert f.resent() == []
    f.durable(2, 6)
    assert f.kept(2) is None and f.kept(1) is not None
    f.durable(2, 7)
    assert f.kept(1) is None


def test_replicated_config_sends_everything_over_plain_tcp():
    config = replicated_config(Config(num_servers=2, transport="auto"), SYNC, "dist_sync")
    assert (config.transport, config.data_channel, config.write_in) == ("tcp", False, False)
    assert replicated_config(Config(num_servers=3), ASYNC, "dist_async").transport == "tcp"
    # host groups are replicated too (their leader's push is numbered as each member's)
    assert replicated_config(Config(num_servers=2, host_reduce=True), SYNC, "dist_sync").host_reduce


@pytest.mark.parametrize("settings, mode, kind, fragment", [
    ({"num_servers": 1}, SYNC, "dist_sync", "KVSTORE_REPLICAS=1 needs at least 2 servers (a backup on another "
                                            "server); this job has 1"),
    ({"num_servers": 2, "server_device": "gpu"}, SYNC, "dist_sync", "with KVSTORE_SERVER_DEVICE=gpu"),
    ({"num_servers": 2, "elastic": (1, 4)}, SSP, "dist_ssp", "with dist_ssp and elastic workers (--elastic)"),
])
def test_replicated_config_refuses_what_is_not_built_naming_the_setting(settings, mode, kind, fragment):
    with pytest.raises(ConfigError) as e:
        replicated_config(Config(**settings), mode, kind)
    assert str(e.value).startswith(f"kvstore.create({kind!r}): ") and fragment in str(e.value)

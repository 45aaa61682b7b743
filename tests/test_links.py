"""The worker's transport registry (kvstore/transport/links): which link a worker
tries for which server and in what order, clear errors for names it does not know,
one file per registered link, and every registered link carrying a whole job
against real servers with the local oracle's sums."""

import importlib
import pathlib

import numpy as np
import pytest

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.transport import Advert, links, shm
from kvstore.transport.links import LINKS, Link, candidates, factory

COLOCATED = Advert("tcp://a:1", "ipc://@x", "h1", 1)
NO_IPC = Advert("tcp://a:1", None, "h1", 1)


def names(found):
    return [(cls.kind, url) for cls, url in found]


def test_an_unknown_transport_is_a_config_error_naming_the_known_ones():
    for call in (lambda: factory("udp"), lambda: candidates(COLOCATED, Config(transport="udp"), True)):
        with pytest.raises(ConfigError, match="unknown transport 'udp'.*auto, shm, ipc, tcp"):
            call()


def test_every_value_of_kvstore_transport_names_a_registered_link():
    """tracker/control/env.py validates the variable (tracker cannot import kvstore):
    a value it accepts must not meet ConfigError here. A link may be registered
    without a value of its own: auto reaches it."""
    from tracker.control.env import TRANSPORTS
    assert set(TRANSPORTS) - {"auto"} <= set(LINKS)


@pytest.mark.parametrize("mode, colocated, advert, expected", [
    ("auto", True, COLOCATED, [("shm", "tcp://a:1"), ("ipc", "ipc://@x"), ("tcp", "tcp://a:1")]),
    ("shm", True, NO_IPC, [("shm", "tcp://a:1"), ("tcp", "tcp://a:1")]),
    ("ipc", True, COLOCATED, [("ipc", "ipc://@x"), ("tcp", "tcp://a:1")]),
    ("ipc", True, NO_IPC, [("tcp", "tcp://a:1")]),
    ("tcp", True, COLOCATED, [("tcp", "tcp://a:1")]),
    ("auto", False, COLOCATED, [("tcp", "tcp://a:1")]),
])
def test_links_are_tried_from_the_one_kvstore_transport_names_on(mode, colocated, advert, expected):
    """The first candidate is the one KVSTORE_TRANSPORT names (or the best for auto);
    the rest are the fall-backs after a failed handshake (shared memory -> ipc -> tcp)."""
    found = names(candidates(advert, Config(transport=mode), colocated))
    assert found == expected


def test_every_link_module_is_registered_and_each_entry_is_a_link_in_its_own_file():
    package = pathlib.Path(links.__file__).parent
    modules = {p.stem for p in package.glob("*_link.py")}
    assert {entry.split(":")[0] for entry in LINKS.values()} == modules
    kinds = set()
    for name in LINKS:
        cls = factory(name)
        assert issubclass(cls, Link) and cls is not Link
        assert importlib.import_module(cls.__module__).__file__.endswith(f"{LINKS[name].split(':')[0]}.py")
        kinds.add(cls.kind)
    assert len(kinds) == len(LINKS)     # Client.transports tells them apart


KEYS = ["big", "small", "ints"]


def exchange(kv):
    """push+pull, pushpull and pushpull into kv.empty() gradients: large chunks (by
    reference, written in, or over a data channel) and small ones (inline)."""
    kv.init(KEYS, [np.zeros((300, 70), np.float32), np.zeros(5, np.float32), np.zeros(40, np.int64)])
    seen = []
    for step in range(3):
        grads = [np.full(s, (kv.rank + 1) * (step + 1), d) for s, d in
                 (((300, 70), np.float32), (5, np.float32), (40, np.int64))]
        if step == 2:
            shared = [kv.empty(g.shape, g.dtype) for g in grads]
            for dst, g in zip(shared, grads):
                dst[...] = g
            grads = shared
        outs = [np.empty_like(g) for g in grads]
        if step == 0:
            kv.push(KEYS, grads)
            kv.pull(KEYS, out=outs)
        else:
            kv.pushpull(KEYS, grads, out=outs)
        seen.append(outs)
    return seen, kv._client.transports, kv.comm_stats()


@pytest.mark.parametrize("name", list(LINKS))
def test_each_registered_link_carries_a_job_with_the_oracles_sums(make_cluster, name):
    cluster = make_cluster(2, 2, transport=name, chunk_bytes=8192, zero_copy_bytes=4096,
                           write_in_bytes=8192, channel_bytes=16384)
    for seen, kinds, stats in cluster.run(exchange):
        assert kinds == [factory(name).kind] * 2
        assert stats["bytes_received"] > 0
        for step, outs in enumerate(seen):
            for got in outs:
                np.testing.assert_array_equal(got, 3 * (step + 1))     # (1 + 2) * (step + 1)


@pytest.mark.skipif(not shm.available(), reason="no memfd_create on this platform")
def test_a_server_refusing_shared_memory_costs_only_its_own_link(make_cluster, monkeypatch):
    """Server 0 cannot map the workers' memory and refuses their hello; server 1's
    handshake, running at the same time, still succeeds (a refusal is not a failed
    call that would drop the other servers' answers)."""
    from kvstore.server import dataplane
    joined = dataplane.DataPlane.joined
    monkeypatch.setattr(dataplane.DataPlane, "joined", lambda self, registration:
                        None if self.config.rank == 0 else joined(self, registration))
    cluster = make_cluster(2, 2, chunk_bytes=8192, zero_copy_bytes=4096, write_in_bytes=8192)
    for seen, kinds, _ in cluster.run(exchange):
        assert kinds == ["ipc", "shm"]
        for step, outs in enumerate(seen):
            for got in outs:
                np.testing.assert_array_equal(got, 3 * (step + 1))

"""The transport registry (kvstore/transport/registry.py) and the worker's links:
which link a worker tries for which server and in what order, clear errors for
names it does not know, one file per registered link and per registered endpoint,
every registered transport carrying a whole job against real servers with the
local oracle's sums, and a transport added by a test with one file per end plus
one registry line carrying a whole job too."""

import importlib
import pathlib
import types

import numpy as np

import pytest

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.transport import Advert, endpoints, links, registry, shm
from kvstore.transport.endpoints import Endpoint
from kvstore.transport.links import Link
from kvstore.transport.links.opening import candidates
from kvstore.transport.registry import TRANSPORTS

COLOCATED = Advert.parse("tcp://a:1 ipc://@x shm host=h1 pid=1")
NO_IPC = Advert.parse("tcp://a:1 shm host=h1 pid=1")


def names(found):
    return [(cls.kind, url) for cls, url in found]


def test_an_unknown_transport_is_a_config_error_naming_the_known_ones():
    for call in (lambda: registry.link("udp", Link), lambda: candidates(COLOCATED, Config(transport="udp"), True)):
        with pytest.raises(ConfigError, match="unknown transport 'udp'.*auto, cuda_ipc, shm, ipc, tcp"):
            call()


def test_the_values_of_kvstore_transport_are_auto_and_the_registered_names(monkeypatch):
    """tracker/control/env.py checks only the variable's syntax (tracker cannot import
    kvstore); kvstore's Config accepts exactly auto and the registry's names, so a
    transport registered later is a valid value without touching tracker."""
    from tracker.control import env
    for name in ("auto", *TRANSPORTS):
        assert Config.from_env({"KVSTORE_TRANSPORT": name.upper()}).transport == name
    with pytest.raises(ConfigError, match="unknown transport 'udp'.*auto, cuda_ipc, shm, ipc, tcp"):
        Config.from_env({"KVSTORE_TRANSPORT": "udp"})
    assert env.read({"KVSTORE_TRANSPORT": "udp"}).transport == "udp"      # a name, for kvstore to judge
    with pytest.raises(env.EnvError):
        env.read({"KVSTORE_TRANSPORT": "no such"})
    monkeypatch.setattr(registry, "TRANSPORTS", {"udp": TRANSPORTS["tcp"], **TRANSPORTS})
    assert Config.from_env({"KVSTORE_TRANSPORT": "udp"}).transport == "udp"


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


@pytest.mark.parametrize("side, package, suffix, base, load", [
    ("link", links, "_link", Link, registry.link),
    ("endpoint", endpoints, "_endpoint", Endpoint, registry.endpoint),
])
def test_every_module_of_each_end_is_registered_and_each_entry_is_a_class_in_its_own_file(
        side, package, suffix, base, load):
    """Each registry line names a worker link in links/ and a server endpoint in
    endpoints/, one file each, whose ``kind`` is the line's name (the advert's key,
    and what Client.transports reports)."""
    folder = pathlib.Path(package.__file__).parent
    modules = {p.stem for p in folder.glob(f"*{suffix}.py")}
    where = {name: getattr(entry, side).partition(":")[0] for name, entry in TRANSPORTS.items()}
    assert {module.rsplit(".", 1)[-1] for module in where.values()} == modules
    for name in TRANSPORTS:
        cls = load(name, base)
        assert issubclass(cls, base) and cls is not base and cls.kind == name
        assert importlib.import_module(cls.__module__).__file__ == str(folder / f"{where[name].rsplit('.', 1)[-1]}.py")


def test_a_class_registered_under_another_name_is_a_config_error(monkeypatch):
    monkeypatch.setattr(registry, "TRANSPORTS", {**TRANSPORTS, "tcp2": TRANSPORTS["tcp"]})
    for load, base in ((registry.link, Link), (registry.endpoint, Endpoint)):
        with pytest.raises(ConfigError, match="transport 'tcp2'.*kind is 'tcp2'"):
            load("tcp2", base)


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


def first_applying(name: str) -> str:
    """The transport a CPU worker (a store without GPUs) uses from ``name`` on: links
    that need device memory (cuda_ipc; its own job runs in test_cuda_ipc.py) do not
    apply and are skipped before their handshake."""
    cpu_worker = types.SimpleNamespace(accelerators=None)
    return next(n for n in registry.chosen(name) if registry.link(n, Link).applies(cpu_worker))


@pytest.mark.parametrize("name", list(TRANSPORTS))
def test_each_registered_link_carries_a_job_with_the_oracles_sums(make_cluster, name):
    cluster = make_cluster(2, 2, transport=name, chunk_bytes=8192, zero_copy_bytes=4096,
                           write_in_bytes=8192, channel_bytes=16384)
    for seen, kinds, stats in cluster.run(exchange):
        assert kinds == [first_applying(name)] * 2
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


# -- a transport added by a test: one file per end (tests/toy_link.py,
# tests/toy_endpoint.py) plus one registry line, nothing else -----------------------
TOY = registry.Transport("toy_link:ToyLink", "toy_endpoint:ToyEndpoint")


def with_toy(transports):
    return {"toy": TOY, **transports}      # first: auto tries it before the others


def toy_job(kv):
    seen, kinds, stats = exchange(kv)
    urls = [link.url for link in kv._client.links]
    return seen, kinds, urls, stats


def test_a_transport_added_with_one_file_per_end_and_one_registry_line_carries_a_job(
        make_cluster, monkeypatch):
    monkeypatch.setattr(registry, "TRANSPORTS", with_toy(TRANSPORTS))
    cluster = make_cluster(2, 2, transport="toy", chunk_bytes=8192, zero_copy_bytes=4096)
    toys = [node._data.endpoints["toy"] for node in cluster.nodes]
    adverts = [Advert.parse(node.address) for node in cluster.nodes]
    for advert, toy in zip(adverts, toys):      # advertised under its name, beside the others
        assert list(advert.transports)[:2] == ["tcp", "toy"] and advert.offers("shm")
        assert advert.url("toy") == f"tcp://127.0.0.1:{toy.port}" != advert.url("tcp")
    for seen, kinds, urls, stats in cluster.run(toy_job):
        assert kinds == ["toy", "toy"]
        assert urls == [a.url("toy") for a in adverts]      # connected to the toy endpoint's port
        assert stats["bytes_received"] > 0
        for step, outs in enumerate(seen):
            for got in outs:
                np.testing.assert_array_equal(got, 3 * (step + 1))
    for toy in toys:
        assert toy.hellos == 2 and toy.noted > 2        # each worker's handshake, then its requests


TOY_JOB = """
import sys
import numpy as np
from kvstore.transport import registry
registry.TRANSPORTS = {"toy": registry.Transport("toy_link:ToyLink", "toy_endpoint:ToyEndpoint"),
                       **registry.TRANSPORTS}
import kvstore
kv = kvstore.create("dist_sync")        # a server runs its role here and exits
kv.init(1, np.zeros(30_000, np.float32))
out = np.empty(30_000, np.float32)
kv.pushpull(1, np.full(30_000, kv.rank + 1, np.float32), out=out)
print("RANK", kv.rank, "SUM-OK", bool((out == 3).all()), "TRANSPORTS", ",".join(kv._client.transports),
      "TOY-URLS", all(link.url == link.advert.url("toy") for link in kv._client.links), flush=True)
kv.close()
"""

TOY_LAUNCH = """
import sys
from tracker.launcher import JobSpec, run_cli
job = (sys.executable, sys.argv[1])
sys.exit(run_cli(JobSpec(num_workers=2, num_servers=2, command=job, server_command=job,
                         env={"KVSTORE_TRANSPORT": "toy", "KVSTORE_CHUNK_BYTES": "16384",
                              "KVSTORE_TIMEOUT": "30"})))
"""


@pytest.mark.slow
def test_a_transport_added_in_the_job_script_carries_a_job_of_real_processes(tmp_path):
    """The same toy in a job of separate processes: the script registers it (servers
    run the script too, and it registers before ``create`` runs their role), and the
    launcher passes KVSTORE_TRANSPORT=toy along without knowing the name."""
    import os
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    script = tmp_path / "job.py"
    script.write_text(TOY_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    p = subprocess.run([sys.executable, "-c", TOY_LAUNCH, str(script)], env=env, capture_output=True,
                       text=True, timeout=120, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(line.split("RANK", 1)[1].split() for line in p.stdout.splitlines() if "RANK " in line)
    assert lines == [[str(rank), "SUM-OK", "True", "TRANSPORTS", "toy,toy", "TOY-URLS", "True"]
                     for rank in (0, 1)], p.stdout + p.stderr

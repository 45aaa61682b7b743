import os
import signal
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# A suite started in the background (`cmd &` in a script ignores SIGINT, `nohup`
# ignores SIGHUP) would pass the ignored signals on to every launcher it starts: an
# ignored signal stays ignored across exec, and the launchers respect that, as they
# should under nohup. The tests that stop a launcher with SIGINT or SIGHUP need the
# signals delivered, so this process takes them back (a handler is reset at exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
pytest.register_assert_rewrite("fuzzing", "optimizer_refs", "state_driver")  # helpers with asserts

from cluster import Cluster  # noqa: E402


@pytest.fixture(autouse=True)
def _no_processes_left_behind():
    """After each test, kill the processes its launchers (tests/services.py Proc) left."""
    import services
    since = len(services.STARTED)
    yield
    services.end_leftovers(since)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The groups pytest-xdist keeps together (``-n 2 --dist loadgroup``, the README's
    command): a test module runs on one worker, so its module-scoped set-ups (an
    sshd, a Slurm cluster, a live job, a reference run) start once; the tests that
    build network namespaces run on one worker, one at a time, since they check
    that no ``kvlink-`` namespace appeared while they ran (state of the machine).
    The docs' snippets are one group per file (each runs in its own directory), and
    the groups holding a test marked slow come first, so that the longest ones do
    not start last and hold the suite's end. Without xdist the marks change nothing."""
    groups = {}
    for item in items:
        if "netns_ok" in getattr(item, "fixturenames", ()):
            group = "netns"
        elif item.nodeid.startswith("tests/project/test_snippets.py::test_snippets_run_as_written["):
            group = item.nodeid.split("::")[1]
        else:
            group = item.nodeid.split("::")[0]
        groups[item.nodeid] = group
        item.add_marker(pytest.mark.xdist_group(group))
    slow = {groups[item.nodeid] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: groups[item.nodeid] not in slow)     # (stable: each group's order kept)


@pytest.fixture
def make_cluster():
    """Start in-process clusters; every one is shut down (and checked) at the end."""
    started = []

    def make(num_workers, num_servers, **settings):
        c = Cluster(num_workers, num_servers, **settings)
        started.append(c)
        return c
    yield make
    for c in started:
        c.close()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A loopback sshd on 127.0.0.1-5 (tests/services.py) for a test module, or skip
    saying what is missing."""
    from services import start_sshd
    server, reason = start_sshd(str(tmp_path_factory.mktemp("sshd")))
    if server is None:
        pytest.skip(reason)
    yield server
    server.stop()


@pytest.fixture
def netns_ok():
    """Skip unless this machine lets us create (and delete) a network namespace
    (the emulated-link benchmarks' tests)."""
    from services import netns_unavailable
    why = netns_unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """A test must not leave kvstore threads behind (servers, heartbeats, scheduler)."""
    before = set(threading.enumerate())
    yield
    def ours():
        return [t for t in threading.enumerate() if t not in before and t.is_alive()
                and t.name.startswith(("kvstore-", "output-"))]
    for t in ours():
        t.join(5)
    leaked = ours()
    assert not leaked, f"leaked threads: {[t.name for t in leaked]}"


@pytest.fixture(params=["host", "device-layer"])
def server_backend(request, monkeypatch):
    """Run a state-machine test on the host backend and on the GPU server's code
    path over the device layer's host device (kvstore.devices.HostDevice), which
    is how CI checks that path without a GPU. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("server_backend")``."""
    import state_driver
    if request.param == "device-layer":
        from kvstore.devices import HostDevice
        from kvstore.server.backend import DeviceBackend
        monkeypatch.setattr(state_driver, "BACKEND", lambda: DeviceBackend(HostDevice()))
    return request.param

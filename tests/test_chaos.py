"""A small fixed subset of benchmarks/chaos.py: one run per fault type, each must
end fast, non-zero, with the culprit marked, nothing left behind and no wrong value."""

import pytest

from benchmarks import chaos

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault, role, workers, servers, mode", [
    ("SIGKILL", "server", 3, 2, "sync"),
    ("SIGTERM", "worker", 2, 2, "async"),
    ("SIGSTOP", "server", 2, 1, "sync"),
    ("exit", "worker", 3, 1, "sync"),
    ("raise", "worker", 2, 3, "async"),
])
def test_one_fault_ends_the_job_cleanly(fault, role, workers, servers, mode):
    run = chaos.run_case(0, workers, servers, mode, fault, role, rank=1 if role == "worker" else 0, after=3)
    assert not run["problems"], run


def test_a_partitioned_machine_ends_the_job_cleanly(netns_ok):
    run = chaos.partition_case(0, 2, 2, "sync", after=3)
    assert not run["problems"], run


@pytest.mark.parametrize("fault, role", [("SIGKILL", "server"), ("raise", "worker")])
def test_one_fault_over_ssh_ends_the_job_cleanly(sshd, fault, role):
    run = chaos.run_case(0, 2, 2, "sync", fault, role, rank=1, after=3, sshd=sshd)
    assert not run["problems"], run

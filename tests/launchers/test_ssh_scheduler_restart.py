"""The scheduler's death in a job started by `python -m tracker.ssh` against a real
sshd on 127.0.0.2-3 (two emulated hosts, CURVE on, as between machines): the
scheduler runs as the launcher's child on this machine, which restarts it on the
same port when worker 0 kills it mid-training (before a barrier, and after a
push); every process registers again over ssh's network path and the job ends
with exit 0 and the weights of an uninterrupted run, bit for bit; nothing is left
on any host."""

import os
import re

import pytest

from services import SCRIPTS, eventually_empty, python_launcher, tagged

pytestmark = pytest.mark.slow

SETTINGS = {"KVSTORE_DETERMINISTIC": "1", "KVSTORE_CHUNK_BYTES": "4096", "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
            "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_TIMEOUT": "30", "BARRIER": "1"}


def digests(text: str) -> set[str]:
    return set(re.findall(r"\[worker:\d[^\]]*\] digest (\w+)", text))


def test_a_scheduler_killed_in_an_ssh_job_is_restarted_and_the_job_ends_with_the_uninterrupted_weights(sshd):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    reference = python_launcher("tracker.local", "-n", "2", "-s", "2", "python",
                                os.path.join(SCRIPTS, "replicated.py"), env={**base, **SETTINGS})
    assert reference.wait(120) == 0, reference.text
    [want] = digests(reference.text)
    hosts = sshd.hostfile("# two loopback hosts", "127.0.0.2:{port}", "", "127.0.0.3:{port}")
    p = python_launcher("tracker.ssh", "-F", sshd.client_config, "--env", "KVSTORE_TEST_TAG", "--env", "PYTHONPATH",
                        "--env", "KILL_SCHEDULER", "--env", "BARRIER", "-n", "2", "-s", "2", "-H", hosts,
                        "--kill-grace", "1", "python", os.path.join(SCRIPTS, "replicated.py"),
                        env={**base, **SETTINGS, "KILL_SCHEDULER": "3:barrier,6:push"})
    assert p.wait(120) == 0, p.text
    restarted = re.findall(r"the scheduler \(pid \d+\) was killed by SIGKILL: restarting it on ([\d.]+:\d+)", p.text)
    assert len(restarted) == 2 and len(set(restarted)) == 1, p.text
    assert p.text.count("the restarted scheduler rebuilt the job from 4 registrations") == 2, p.text
    assert digests(p.text) == {want}, p.text
    assert eventually_empty(lambda: tagged(p.tag)) == [], f"processes left behind:\n{p.text}"
    assert eventually_empty(sshd.sessions) == [], f"ssh sessions left behind:\n{p.text}"

"""A real training job on replicated servers (KVSTORE_REPLICAS=1): examples/train_cifar10.py
(kvstore.torch's Trainer, the optimizer on the servers, ResNet-20) on the tiny
CIFAR-10 set, 3 epochs through `python -m tracker.local -n 2 -s 3`, server 1
killed with SIGKILL from outside at a batch of epoch 1 (an event in the job's
output, not a time): the job ends with exit 0, and every training and validation
accuracy the workers log is the uninterrupted run's (deterministic sums)."""

import os
import re
import signal
import sys

import pytest

from services import ROOT, descendants, environ_of, python_launcher
from tiny_cifar import write_tiny_cifar

pytestmark = pytest.mark.timeout(300)

SETTINGS = {"KVSTORE_DETERMINISTIC": "1", "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
            "KVSTORE_TIMEOUT": "60", "KVSTORE_CHUNK_BYTES": "65536"}


def accuracies(text: str) -> list[str]:
    """Each worker's logged accuracies, in order (speeds and byte counts left out)."""
    found = re.findall(r"\[worker:(\d)\] .*(Epoch\[\d\] (?:Batch \[\d+\].*accuracy=[\d.]+|Validation-accuracy=[\d.]+))",
                       text)
    speed = re.compile(r"Speed: [\d.]+ samples/sec")
    return [w + " " + speed.sub("", line) for w, line in sorted(found, key=lambda x: x[0])]


def train(data: str, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return python_launcher("tracker.local", "-n", "2", "-s", "3", sys.executable, "examples/train_cifar10.py",
                           "--kvstore", "dist_sync", "--data-dir", data, "--network", "resnet",
                           "--num-layers", "20", "--num-examples", "72", "--num-epochs", "3",
                           "--batch-size", "8", "--disp-batches", "2", env={**base, **SETTINGS, **env}, cwd=ROOT)


def test_train_cifar10_survives_a_killed_server_with_the_uninterrupted_accuracies(tmp_path):
    data = str(write_tiny_cifar(tmp_path / "cifar"))
    reference = train(data)
    assert reference.wait(240) == 0, reference.text
    want = accuracies(reference.text)
    assert len(want) >= 10 and any("Epoch[2] Validation" in line for line in want), reference.text
    job = train(data, KVSTORE_REPLICAS="1")
    job.wait_for(r"Epoch\[1\] Batch \[2\]", timeout=240)
    [server] = [pid for pid in descendants(job.popen.pid)
                if environ_of(pid).get("KVSTORE_ROLE") == "server" and environ_of(pid).get("KVSTORE_RANK") == "1"]
    os.kill(server, signal.SIGKILL)
    assert job.wait(240) == 0, job.text
    assert re.search(r"server 1 \(pid \d+ on [^)]+\) was killed by SIGKILL: its chunks are served by their backups", job.text), \
        job.text
    assert accuracies(job.text) == want, job.text

"""examples/train_sparse.py (wide & deep, the wide part a row-sparse table on the
servers): its hashed crosses, and a dist_sync run through tracker.local (2 workers,
2 servers) that takes the same steps as one process with the ``local`` store.

Why the two runs must agree, by construction:

- Data: each worker's batch is its slice of a global batch
  (``datasets.global_batches``), so the local run with ``--batch-size 2b`` takes
  global batch k whole where worker r of the dist run takes its r-th half of it.
- Gradients: each process's loss is the mean over its own batch, and the Trainer
  makes the servers' optimizer rescale the merged gradient by 1/W, for the dense
  keys and the row-sparse table alike; so the dist update uses
  (1/2) * sum_r (1/b) * sum_{i in half r} g_i, which is the local run's
  (1/2b) * sum_i g_i. LeNet has no batch statistics (no BatchNorm, no dropout), so
  a half batch gives every sample the same output as the whole one.
- Start: ``torch.manual_seed(seed)`` builds the same LeNet everywhere (and rank 0's
  values win); the table starts at zeros, made on the servers.
- Updates: the same momentum SGD, lazy for the table (only rows in a step's
  gradient and their momentum move), the same learning-rate schedule.

What differs is the order of float additions (one sum over 2b samples against two
sums of b added on the server), so after 4 steps the parameters agree to a few
units in the 6th digit, and the table's nonzero rows are the same set exactly.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_examples import ROOT, mnist_dir, run  # noqa: E402,F401  (mnist_dir: a fixture)

sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_sparse import hashed_crosses  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STEPS = 4
BATCH = 32             # per worker


def args(data_dir, steps):
    return ["examples/train_sparse.py", "--data-dir", str(data_dir), "--num-examples", str(steps * 2 * BATCH),
            "--num-epochs", "1", "--disp-batches", "2", "--wide-rows", "100000"]


def train_local(data_dir, steps, path):
    """One process, the local store, the global batch (2 x BATCH); parameters saved to ``path``."""
    p = subprocess.run([sys.executable, *args(data_dir, steps), "--kvstore", "local",
                        "--batch-size", str(2 * BATCH), "--save-params", str(path)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stderr, torch.load(path, weights_only=True)


def test_crosses_of_one_bright_pixel_are_its_four_pairs():
    images = np.zeros((2, 1, 28, 28), np.float32)
    images[1, 0, 5, 5] = 1.0                  # level 3 of 4; everything else is background
    ids, offsets = hashed_crosses(images, 4, 1 << 22)
    assert offsets.tolist() == [0, 0]          # image 0 has no crosses, image 1 has all of them
    assert len(ids) == 4 and len(set(ids.tolist())) == 4    # left, right, above, below
    assert ids.dtype == np.int64 and ((ids >= 0) & (ids < 1 << 22)).all()
    moved = np.zeros_like(images[1:])
    moved[0, 0, 5, 6] = 1.0                  # the same pixel one column right: other pairs
    assert not set(hashed_crosses(moved, 4, 1 << 22)[0].tolist()) & set(ids.tolist())
    dim = images[1:] * 0.5                   # level 2 instead of 3: other crosses
    assert not set(hashed_crosses(dim, 4, 1 << 22)[0].tolist()) & set(ids.tolist())
    small = hashed_crosses(images, 4, 7)[0]  # any table size
    assert ((small >= 0) & (small < 7)).all()


@pytest.mark.slow
def test_dist_sync_takes_the_steps_of_one_local_process(mnist_dir, tmp_path):  # noqa: F811
    log = run(["-n", "2", "-s", "2", sys.executable, *args(mnist_dir, STEPS), "--kvstore", "dist_sync",
               "--batch-size", str(BATCH), "--save-params", str(tmp_path / "dist.pt")])
    for pattern in (r"\[worker:1\] .*Epoch\[0\] Batch \[2\]\tSpeed: [\d.]+ samples/sec\taccuracy=[\d.]+",
                    r"\[worker:0\] .*Epoch\[0\] Comm-sent-bytes=[1-9]\d+",
                    r"\[worker:0\] .*Epoch\[0\] Validation-accuracy=[\d.]+"):
        assert re.search(pattern, log), pattern
    local_log, want = train_local(mnist_dir, STEPS, tmp_path / "local.pt")
    assert re.search(r"Epoch\[0\] Validation-accuracy=[\d.]+", local_log)
    got = torch.load(tmp_path / "dist.pt", weights_only=True)
    assert got.keys() == want.keys() and "deep.9.weight" in want
    assert len(want["wide.rows"]) > 100                    # the steps did move table rows
    assert torch.equal(got["wide.rows"], want["wide.rows"])
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    # the tolerance tells runs apart: one step fewer is far outside it
    _, fewer = train_local(mnist_dir, STEPS - 1, tmp_path / "fewer.pt")
    assert not torch.allclose(fewer["deep.9.weight"], want["deep.9.weight"], rtol=1e-4, atol=1e-5)

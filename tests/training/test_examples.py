"""The training examples as users run them: through tracker.local, on a small
data set written here in the real IDX format; MXNet-format logs; a run stopped
after epoch 1 and resumed ends with exactly the weights of an uninterrupted run."""

import gzip
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.worker import states_file  # noqa: E402
from tiny_cifar import write_tiny_cifar  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def write_idx(path, array):
    codes = {np.dtype(np.uint8): 0x08}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory):
    """A learnable little MNIST: the label is drawn as a bright bar at row 2*label."""
    d = tmp_path_factory.mktemp("mnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 512), ("t10k", 128)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 * label + 4, 4:24] = 255
        write_idx(d / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(d / f"{split}-labels-idx1-ubyte.gz", labels)
    return d


def run(args, timeout=240, env=None):
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_HEARTBEAT_TIMEOUT": "20", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "tracker.local", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def train(mnist_dir, prefix, *extra):
    return run(["-n", "2", "-s", "2", sys.executable, "examples/train_mnist.py",
                "--kvstore", "dist_sync", "--data-dir", str(mnist_dir), "--network", "mlp",
                "--batch-size", "32", "--disp-batches", "4", "--lr", "0.1",
                "--model-prefix", str(prefix), *extra])


def test_train_mnist_logs_in_mxnet_format_and_resumes_exactly(mnist_dir, tmp_path):
    full = train(mnist_dir, tmp_path / "full", "--num-epochs", "2")
    for pattern in (r"\[worker:0\] .*Epoch\[0\] Batch \[4\]\tSpeed: [\d.]+ samples/sec\taccuracy=[\d.]+",
                    r"\[worker:1\] .*Epoch\[1\] Train-accuracy=[\d.]+",
                    r"Epoch\[1\] Time cost=[\d.]+", r"Epoch\[1\] Validation-accuracy=[\d.]+",
                    r"Epoch\[0\] Comm-sent-bytes=[1-9]\d+", r"Epoch\[0\] Comm-received-bytes=[1-9]\d+"):
        assert re.search(pattern, full), pattern
    accuracy = float(re.findall(r"\[worker:0\] .*Epoch\[1\] Validation-accuracy=([\d.]+)", full)[0])
    assert accuracy > 0.5      # it learned (chance is 0.1)

    train(mnist_dir, tmp_path / "part", "--num-epochs", "1")
    train(mnist_dir, tmp_path / "part", "--num-epochs", "2", "--load-epoch", "1")
    want = torch.load(tmp_path / "full-0002.params", weights_only=True)
    got = torch.load(tmp_path / "part-0002.params", weights_only=True)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    _, want_states = states_file.load(str(tmp_path / "full-0002.states"))
    _, got_states = states_file.load(str(tmp_path / "part-0002.states"))
    for key in want_states:
        assert got_states[key]["t"] == want_states[key]["t"]
        for a, b in zip(got_states[key]["state"], want_states[key]["state"]):
            np.testing.assert_array_equal(a, b)


def test_minimal_custom_loop_example_runs(mnist_dir):
    out = run(["-n", "2", "-s", "1", sys.executable, "examples/dist_sync_mlp.py",
               "--num-epochs", "1", "--data-dir", str(mnist_dir)])
    assert re.search(r"\[worker:1\] Epoch\[0\] Validation-accuracy=[\d.]+", out)


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    """96 random images in the python-version format: 2 training batches of 36, a test batch of 24."""
    return write_tiny_cifar(tmp_path_factory.mktemp("cifar"))


def test_train_cifar10_on_a_tiny_set_in_the_real_format_and_parse_the_log(cifar_dir, tmp_path):
    out = run(["-n", "2", "-s", "1", sys.executable, "examples/train_cifar10.py", "--kvstore", "dist_sync",
               "--data-dir", str(cifar_dir), "--network", "resnet", "--num-layers", "20", "--num-examples", "72",
               "--num-epochs", "1", "--batch-size", "8", "--disp-batches", "2"])
    assert re.search(r"\[worker:1\] .*Epoch\[0\] Validation-accuracy=[\d.]+", out)
    log = tmp_path / "train.log"
    log.write_text(out)
    table = subprocess.run([sys.executable, "-m", "kvstore.tools.parse_log", str(log)],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert table.returncode == 0, table.stderr
    assert re.search(r"\| *0 *\|", table.stdout)   # a row for epoch 0


# MXNet 1.9.1's example/image-classification/README.md, "How to train with multiple machines"
# (its launch.py -n 2 -H hosts becomes tracker.local -n 2 -s 2)
MXNET_DOCS_COMMAND = ("python train_cifar10.py --network resnet --num-layers 110 --batch-size 128 --gpus 0,1 "
                      "--kv-store dist_device_sync").split()[2:]


@pytest.mark.timeout(300)   # ResNet-110, batches of 128: about 10 s alone, more beside other tests
def test_an_mxnet_docs_command_line_runs_unchanged_under_tracker_local(cifar_dir):
    """The docs' command line, then MXNet flags that fit it to this machine and a few
    batches: no GPU here (--gpus ''), the tiny data set, an epoch of 512 images (each of
    the 2 workers: 2 batches of 128, its 36 images read over and over)."""
    out = run(["-n", "2", "-s", "2", sys.executable, "examples/train_cifar10.py", *MXNET_DOCS_COMMAND,
               "--gpus", "", "--data-train", str(cifar_dir), "--data-val", str(cifar_dir / "test_batch"),
               "--num-examples", "512", "--num-epochs", "1", "--disp-batches", "1"], timeout=300)
    for w in (0, 1):
        started = re.search(rf"\[worker:{w}\] .*start with arguments Namespace\((.*)\)", out).group(1)
        for setting in ("network='resnet'", "num_layers=110", "batch_size=128", "kvstore='dist_device_sync'",
                        "image_shape='3,28,28'", "pad_size=4", "lr=0.05", "lr_step_epochs='200,250'"):
            assert setting in started, setting
        assert re.search(rf"\[worker:{w}\] .*Resizing training data to 2 batches per machine", out)
        assert re.search(rf"\[worker:{w}\] .*Epoch\[0\] Batch \[2\]\tSpeed: [\d.]+ samples/sec\taccuracy=", out)
        assert not re.search(rf"\[worker:{w}\] .*Epoch\[0\] Batch \[3\]", out)
        assert re.search(rf"\[worker:{w}\] .*Epoch\[0\] Validation-accuracy=[\d.]+", out)


def test_fit_flags_of_a_dist_job_gc_2bit_top_k_pow2_and_profiles(cifar_dir, tmp_path):
    """--gc-type 2bit: each worker sends under 1/8 of the uncompressed gradients' bytes
    (2 bits of 32 a value: 1/16, plus headers); --top-k and --loss add their lines;
    --lr-step-epochs pow2 runs; the profile suffixes write the servers' and workers' files."""
    out = run(["-n", "2", "-s", "2", sys.executable, "examples/train_cifar10.py", "--kv-store", "dist_sync",
               "--network", "mlp", "--data-train", str(cifar_dir), "--num-examples", "64", "--batch-size", "8",
               "--num-epochs", "2", "--gc-type", "2bit", "--gc-threshold", "0.5", "--top-k", "5", "--loss", "ce",
               "--lr-step-epochs", "pow2", "--lr", "0.001", "--profile-server-suffix", "server.json",
               "--profile-worker-suffix", str(tmp_path / "worker.json"), "--disp-batches", "2"],
              env={"KVSTORE_PROFILE_DIR": str(tmp_path / "servers")})
    params = 3 * 28 * 28 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10       # the mlp on 3x28x28 crops
    batches = 64 // 2 // 8
    assert re.search(r"\[worker:0\] .*gradient compression: 2bit, threshold 0.5", out)
    for w in (0, 1):
        sent = [int(v) for v in re.findall(rf"\[worker:{w}\] .*Epoch\[\d\] Comm-sent-bytes=(\d+)", out)]
        assert len(sent) == 2 and all(0 < v < 4 * params * batches / 8 for v in sent), (sent, params * batches)
        for line in (r"Epoch\[1\] Batch \[2\]\tSpeed: [\d.]+ samples/sec\taccuracy=[\d.]+\t"
                     r"top_k_accuracy_5=[\d.]+\tcross-entropy=[\d.]+",
                     r"Epoch\[1\] Train-top_k_accuracy_5=[\d.]+", r"Epoch\[1\] Validation-top_k_accuracy_5=[\d.]+",
                     r"Epoch\[1\] Validation-cross-entropy=[\d.]+"):
            assert re.search(rf"\[worker:{w}\] .*" + line, out), line
        assert os.path.getsize(tmp_path / f"rank{w}_worker.json") > 0
    assert sorted(os.listdir(tmp_path / "servers")) == ["server-0-server.prof", "server-1-server.prof"]


def test_train_cifar10_gc_none_sends_the_whole_gradients(cifar_dir):
    """The control of the 2bit test: without compression each step sends at least
    every gradient in float32."""
    out = run(["-n", "2", "-s", "1", sys.executable, "examples/train_cifar10.py", "--kv-store", "dist_sync",
               "--network", "mlp", "--data-train", str(cifar_dir), "--num-examples", "64", "--batch-size", "8",
               "--num-epochs", "1"])
    params = 3 * 28 * 28 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    sent = int(re.search(r"\[worker:0\] .*Epoch\[0\] Comm-sent-bytes=(\d+)", out).group(1))
    assert sent >= 4 * params * 4


def test_train_mnist_in_an_elastic_job_survives_a_killed_worker_and_its_replacement_joins(mnist_dir):
    """The README job with --elastic: worker 1 is killed in epoch 0, the launcher starts
    a replacement, which joins at the start of a later epoch with the others' weights
    (then every worker evaluates the same weights: equal validation accuracies)."""
    from services import Proc
    job = Proc([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1", "--elastic", "1:2",
                "--max-restarts", "1", sys.executable, "examples/train_mnist.py", "--kvstore", "dist_sync",
                "--data-dir", str(mnist_dir), "--network", "mlp", "--batch-size", "2", "--disp-batches", "8",
                "--lr", "0.05", "--num-epochs", "12"], env={"KVSTORE_HEARTBEAT_TIMEOUT": "20"})
    job.wait_for(r"\[worker:1\] .*Epoch\[0\] Batch \[16\]", timeout=120)
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_worker(int(p), job.tag, 1)]
    assert len(pids) == 1, pids
    os.kill(pids[0], 9)
    assert job.wait(240) == 0, job.text
    joined = re.search(r"\[worker:1\] .*joined the running job at epoch (\d+) as worker 1 of \[0, 1\]", job.text)
    assert joined, job.text
    assert "started worker 1 #1 in place of worker 1" in job.text
    final = {w: re.findall(rf"\[worker:{w}\] .*Epoch\[11\] Validation-accuracy=(\S+)", job.text) for w in (0, 1)}
    assert final[0] and final[0] == final[1], final


def _is_worker(pid: int, tag: str, rank: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return False
    return (env.get(b"KVSTORE_TEST_TAG") == tag.encode() and env.get(b"KVSTORE_ROLE") == b"worker"
            and env.get(b"KVSTORE_RANK") == str(rank).encode() and b"python" in open(
                f"/proc/{pid}/cmdline", "rb").read())

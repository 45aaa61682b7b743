"""examples/train_cifar10.py against MXNet 1.9.1's train_cifar10.py, common/fit.py and
common/data.py: every flag parses with MXNet's default, every one takes a value, the
docs list each; the image pipeline as MXNet's augmenter, the epoch size, the lr
schedule (pow2), the momentum and warm-up rules, the metrics, the initializers, mixed
precision, --test-io, --save-period and --monitor in one process (the 'local' store);
an unsupported value exits with status 1 and a message naming the flag.
(tests/training/test_examples.py runs the script under tracker.local.)"""

import argparse
import logging
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import common  # noqa: E402
import initializers  # noqa: E402
import train_cifar10  # noqa: E402
from tiny_cifar import write_tiny_cifar  # noqa: E402
from datasets import epoch_size, resized_batches  # noqa: E402
from image_pipeline import NOT_HERE, ImageAug  # noqa: E402

import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# MXNet 1.9.1's flags of train_cifar10.py (fit.add_fit_args, data.add_data_args,
# data.add_data_aug_args, then its set_defaults), transcribed: flag -> (its default, a
# value other than the default as typed on a command line, the value parsed)
MXNET_FLAGS = {
    # common/fit.py
    "--network": ("resnet", "mlp", "mlp"),
    "--num-layers": (110, "20", 20),
    "--gpus": (None, "", ""),
    "--kv-store": ("device", "dist_sync", "dist_sync"),
    "--num-epochs": (300, "3", 3),
    "--lr": (0.05, "0.2", 0.2),
    "--lr-factor": (0.1, "0.5", 0.5),
    "--lr-step-epochs": ("200,250", "pow2", "pow2"),
    "--initializer": ("default", "msra", "msra"),
    "--optimizer": ("sgd", "nag", "nag"),
    "--mom": (0.9, "0.8", 0.8),
    "--wd": (0.0001, "0.001", 0.001),
    "--batch-size": (128, "16", 16),
    "--disp-batches": (20, "5", 5),
    "--model-prefix": (None, "model/cifar", "model/cifar"),
    "--save-period": (1, "2", 2),
    "--monitor": (0, "10", 10),
    "--load-epoch": (None, "3", 3),
    "--top-k": (0, "5", 5),
    "--loss": ("", "ce", "ce"),
    "--test-io": (0, "1", 1),
    "--dtype": ("float32", "float16", "float16"),
    "--gc-type": ("none", "2bit", "2bit"),
    "--gc-threshold": (0.5, "1.5", 1.5),
    "--macrobatch-size": (0, "1024", 1024),
    "--warmup-epochs": (5, "2", 2),
    "--warmup-strategy": ("linear", "power2", "power2"),
    "--profile-worker-suffix": ("", "worker.json", "worker.json"),
    "--profile-server-suffix": ("", "server.json", "server.json"),
    "--use-imagenet-data-augmentation": (0, "1", 1),
    # common/data.py: add_data_args
    "--data-train": ("data/cifar10_train.rec", "/data/cifar", "/data/cifar"),
    "--data-train-idx": ("", "train.idx", "train.idx"),
    "--data-val": ("data/cifar10_val.rec", "/data/cifar/test_batch", "/data/cifar/test_batch"),
    "--data-val-idx": ("", "val.idx", "val.idx"),
    "--rgb-mean": ("123.68,116.779,103.939", "125.307,122.961,113.8575", "125.307,122.961,113.8575"),
    "--rgb-std": ("1,1,1", "51.5865,50.847,51.255", "51.5865,50.847,51.255"),
    "--pad-size": (4, "2", 2),
    "--fill-value": (127, "0", 0),
    "--image-shape": ("3,28,28", "3,32,32", "3,32,32"),
    "--num-classes": (10, "5", 5),
    "--num-examples": (50000, "1000", 1000),
    "--data-nthreads": (4, "8", 8),
    "--benchmark": (0, "1", 1),
    # common/data.py: add_data_aug_args
    "--random-crop": (0, "1", 1),
    "--random-mirror": (0, "1", 1),
    "--max-random-h": (0, "36", 36),
    "--max-random-s": (0, "50", 50),
    "--max-random-l": (0, "50", 50),
    "--min-random-aspect-ratio": (None, "0.75", 0.75),
    "--max-random-aspect-ratio": (0, "0.25", 0.25),
    "--max-random-rotate-angle": (0, "10", 10),
    "--max-random-shear-ratio": (0, "0.1", 0.1),
    "--max-random-scale": (1, "1.2", 1.2),
    "--min-random-scale": (1, "0.8", 0.8),
    "--max-random-area": (1, "0.9", 0.9),
    "--min-random-area": (1, "0.08", 0.08),
    "--min-crop-size": (-1, "20", 20),
    "--max-crop-size": (-1, "28", 28),
    "--brightness": (0, "0.4", 0.4),
    "--contrast": (0, "0.4", 0.4),
    "--saturation": (0, "0.4", 0.4),
    "--pca-noise": (0, "0.1", 0.1),
    "--random-resized-crop": (0, "1", 1),
}
# where this script's default differs, and why: MXNet's script downloads RecordIO files
# into data/ and points at them; here None means the CIFAR-10 python batches of --data-dir
# (downloaded there) and the test_batch beside the training data
OUR_DEFAULTS = {"--data-train": None, "--data-val": None}


def dest(flag: str) -> str:
    return "kvstore" if flag == "--kv-store" else flag[2:].replace("-", "_")


def test_every_mxnet_flag_parses_with_mxnets_default():
    assert len(MXNET_FLAGS) == 63
    args = train_cifar10.build_parser().parse_args([])
    for flag, (default, _, _) in MXNET_FLAGS.items():
        assert getattr(args, dest(flag)) == OUR_DEFAULTS.get(flag, default), flag


def test_every_mxnet_flag_takes_a_value():
    argv = [part for flag, (_, text, _) in MXNET_FLAGS.items() for part in (flag, text)]
    args = train_cifar10.build_parser().parse_args(argv)
    for flag, (default, _, value) in MXNET_FLAGS.items():
        assert getattr(args, dest(flag)) == value != default, flag
    # MXNet's spelling and ours of the store flag are one flag
    assert train_cifar10.build_parser().parse_args(["--kvstore", "local"]).kvstore == "local"


def test_docs_list_every_flag_with_its_status():
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        rows = [line for line in f if line.startswith("| `--")]
    for flag in MXNET_FLAGS:
        assert any(line.startswith(f"| `{flag}`") and line.count("|") >= 4 for line in rows), flag


# ---------------------------------------------------------------- exit status 1, never 2

def exit_message(argv) -> str:
    """main(argv)'s SystemExit as a message (a str code: exit status 1; "<script>: error: ...",
    the script being sys.argv[0]: pytest's here, see the real process below)."""
    with pytest.raises(SystemExit) as info:
        train_cifar10.main(argv)
    assert isinstance(info.value.code, str), info.value.code    # not argparse's 2, not 0
    return info.value.code


@pytest.fixture(scope="module")
def tiny_cifar(tmp_path_factory):
    """96 random images in the python-version format: 2 training batches of 36, a test batch of 24."""
    return write_tiny_cifar(tmp_path_factory.mktemp("cifar"))


def small(tiny_cifar, *extra):
    return ["--kv-store", "local", "--data-dir", str(tiny_cifar), "--network", "mlp", "--num-examples", "32",
            "--batch-size", "8", "--num-epochs", "1", *extra]


@pytest.mark.parametrize("flag", sorted(NOT_HERE))
def test_an_augmentation_this_pipeline_lacks_is_a_clear_error(flag, tiny_cifar):
    value = MXNET_FLAGS["--" + flag.replace("_", "-")][1]
    message = exit_message(small(tiny_cifar, "--" + flag.replace("_", "-"), value))
    assert ": error: --" + flag.replace("_", "-") + " " in message, message
    assert "not in this script's image pipeline" in message


@pytest.mark.parametrize("extra,says", [
    (["--dtype", "bfloat16"], "--dtype 'bfloat16': expected float32 or float16"),
    (["--top-k", "1"], "--top-k 1"),
    (["--gc-type", "3bit"], "unknown gradient compression type '3bit'"),
    (["--initializer", "lecun"], "--initializer 'lecun'"),
    (["--lr-step-epochs", "30,x"], "--lr-step-epochs '30,x'"),
    (["--lr-step-epochs", "0"], "increasing epochs >= 1"),
    (["--network", "alexnet"], "unknown network 'alexnet'"),
    (["--optimizer", "lbnag"], "unknown optimizer 'lbnag'"),
    (["--warmup-strategy", "cubic", "--optimizer", "lbsgd"], "warmup_strategy must be one of"),
    (["--kv-store", "nccl"], "MXNet's 'nccl' store"),
    (["--image-shape", "3,36,36"], "the crop is larger than the 32x32 images"),
    (["--image-shape", "1,28,28"], "3 channels"),
    (["--rgb-mean", "1,2"], "--rgb-mean '1,2': expected 3"),
    (["--data-train", "data/cifar10_train.rec"], "an MXNet RecordIO file"),
    (["--data-val-idx", "val.idx"], "--data-val-idx 'val.idx': a RecordIO index"),
    (["--profile-server-suffix", "../x.json"], "a name, not a path"),
    (["--gpus", "a"], "--gpus 'a'"),
    (["--num-classes", "5"], "--num-classes is 5"),
])
def test_an_unsupported_value_exits_1_with_a_message(extra, says, tiny_cifar):
    message = exit_message(small(tiny_cifar, *extra))
    assert ": error: " in message and says in message, message


def test_a_real_process_exits_with_status_1_not_2(tiny_cifar):
    p = subprocess.run([sys.executable, "examples/train_cifar10.py", *small(tiny_cifar, "--dtype", "int8")],
                       cwd=ROOT, capture_output=True, text=True, timeout=90,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().endswith("train_cifar10.py: error: --dtype 'int8': expected float32 or float16")
    assert "Traceback" not in p.stderr


# ---------------------------------------------------------------- the image pipeline

def test_mxnets_default_pipeline_is_a_centre_crop_minus_the_mean():
    args = train_cifar10.build_parser().parse_args([])
    aug = ImageAug.from_args(args)
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    mean = np.array([123.68, 116.779, 103.939]).reshape(1, 3, 1, 1)
    want = images[:, :, 2:30, 2:30] - mean          # pad 4 then a centre 28x28 crop of the 40x40
    for got in (aug.train(images, np.random.default_rng(0)), aug.val(images)):
        assert got.dtype == np.float32 and got.shape == (4, 3, 28, 28)
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_random_crops_reach_the_fill_value_and_mirror_flips():
    aug = ImageAug(shape=(3, 30, 32), pad=2, fill_value=9, random_crop=True, random_mirror=True)
    images = np.random.default_rng(0).integers(10, 256, (200, 3, 32, 32), dtype=np.uint8)
    draws = np.random.default_rng(3)
    offsets = draws.integers(0, np.array([7, 5]), size=(200, 2))      # rows 0..6, columns 0..4
    flips = draws.random((200,)) < 0.5
    out = aug.train(images, np.random.default_rng(3))
    padded = np.pad(images, ((0, 0), (0, 0), (2, 2), (2, 2)), constant_values=9)
    for i in range(200):
        r, c = offsets[i]
        crop = padded[i, :, r:r + 30, c:c + 32]
        np.testing.assert_array_equal(out[i], crop[:, :, ::-1] if flips[i] else crop)
    assert set(offsets[:, 0]) == set(range(7)) and set(offsets[:, 1]) == set(range(5))
    assert (out == 9).any() and 0 < flips.sum() < 200


def test_standard_cifar_recipe_normalises_with_the_given_mean_and_std():
    argv = ["--image-shape", "3,32,32", "--pad-size", "0", "--rgb-mean", "10,20,30", "--rgb-std", "2,4,5"]
    aug = ImageAug.from_args(train_cifar10.build_parser().parse_args(argv))
    images = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    want = (images - np.array([10, 20, 30]).reshape(1, 3, 1, 1)) / np.array([2, 4, 5]).reshape(1, 3, 1, 1)
    np.testing.assert_allclose(aug.val(images), want, rtol=1e-6)
    np.testing.assert_allclose(aug.train(images, np.random.default_rng(0)), want, rtol=1e-6)


# ---------------------------------------------------------------- epochs, lr schedule, optimizer

def test_the_epoch_rounds_up_and_every_worker_runs_it_in_full():
    assert epoch_size(50000, 128, 1) == 391 and epoch_size(50000, 128, 3) == 131   # ceil(16666 / 128)
    assert epoch_size(100, 8, 2) == 7
    parts = [list(resized_batches(100, 8, rank, 2, epoch=0, batches=7)) for rank in (0, 1)]
    for part in parts:
        assert len(part) == 7 and all(len(b) == 8 for b in part)
        flat = np.concatenate(part)
        assert len(set(flat[:50])) == 50 and np.array_equal(flat[50:], flat[:6])   # 50 each, then again
    assert not set(np.concatenate(parts[0])) & set(np.concatenate(parts[1]))
    # a part smaller than a batch is read over and over
    assert [len(b) for b in resized_batches(3, 4, 0, 1, 0, batches=2)] == [4, 4]


def fit_args(*argv):
    return train_cifar10.build_parser().parse_args(list(argv))


def test_lr_step_epochs_pow2_is_a_polynomial_decay_to_zero_over_the_run():
    opt = common.make_optimizer(fit_args("--lr", "0.4", "--lr-step-epochs", "pow2", "--num-epochs", "10"), 50)
    sched = opt.lr_scheduler
    assert type(sched).__name__ == "PolyScheduler" and sched.max_update == 500 and sched.pwr == 2
    for t, want in ((1, 0.4 * (499 / 500) ** 2), (250, 0.4 * 0.25), (400, 0.4 * 0.04), (500, 0.0), (600, 0.0)):
        assert math.isclose(sched(t), want, rel_tol=1e-9, abs_tol=1e-12), t
    for spec in ("pow 0.5", "pow-3"):
        assert common.make_optimizer(fit_args("--lr-step-epochs", spec), 50).lr_scheduler.pwr in (0.5, 3)
    # --lr-factor >= 1: no schedule at all (fit.py returns before looking at the steps)
    assert common.make_optimizer(fit_args("--lr-step-epochs", "pow2", "--lr-factor", "1"), 50).lr_scheduler is None
    steps = common.make_optimizer(fit_args("--lr-step-epochs", "2,5"), 50).lr_scheduler
    assert list(steps.step) == [100, 250] and steps.factor == 0.1


@pytest.mark.parametrize("name,gets", [("sgd", True), ("nag", True), ("signum", True), ("dcasgd", True),
                                       ("lbsgd", True), ("lars", False), ("adam", False)])
def test_mom_reaches_fit_pys_momentum_optimizers_only(name, gets):
    opt = common.make_optimizer(fit_args("--optimizer", name, "--mom", "0.7"), 10)
    assert (getattr(opt, "momentum", None) == 0.7) is gets


class Workers:
    """What make_optimizer reads of a store."""
    type, staleness = "dist_sync", 0

    def __init__(self, n):
        self.num_workers = n


def test_lbsgd_gets_fit_pys_warm_up():
    args = fit_args("--optimizer", "lbsgd", "--batch-size", "32", "--macrobatch-size", "200",
                    "--warmup-epochs", "3", "--warmup-strategy", "sqrt", "--num-epochs", "9")
    opt = common.make_optimizer(args, 40, Workers(2))
    assert opt.batch_scale == math.ceil(200 / 32 / 2) == 4
    assert (opt.updates_per_epoch, opt.warmup_epochs, opt.warmup_strategy, opt.num_epochs) == (40, 3, "sqrt", 9)
    assert opt.begin_epoch == 0          # the update counts come back from a checkpoint
    assert opt.momentum == 0.9
    # a macro-batch below batch x workers is raised to it: batch_scale 1
    assert common.make_optimizer(fit_args("--optimizer", "lbsgd"), 40, Workers(2)).batch_scale == 1


# ---------------------------------------------------------------- metrics, initializers

def test_top_k_and_loss_metrics():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 2.0, 0.0]])
    labels = torch.tensor([1, 3, 0])
    m = common.EvalMetrics(top_k=2, losses=common.loss_metrics("ce, nll,bogus"))
    m.update(logits, labels)
    values = dict(m.name_values())
    assert list(values) == ["accuracy", "top_k_accuracy_2", "cross-entropy", "nll-loss"]
    assert values["accuracy"] == pytest.approx(1 / 3) and values["top_k_accuracy_2"] == pytest.approx(2 / 3)
    p = torch.softmax(logits, 1)[torch.arange(3), labels]
    assert values["cross-entropy"] == pytest.approx(float(-(p + 1e-12).log().mean()), rel=1e-6)
    # k above the number of classes counts every sample (MXNet clips k)
    big = common.EvalMetrics(top_k=7)
    big.update(logits, labels)
    assert dict(big.name_values())["top_k_accuracy_7"] == 1.0


def test_mxnet_initializers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 128, 3), torch.nn.BatchNorm2d(128), torch.nn.Flatten(),
                                torch.nn.Linear(512, 10))
    with torch.no_grad():
        model[1].weight.fill_(3.0)
        model[1].running_var.fill_(5.0)
    initializers.initialize(model, "default", "resnet")     # Xavier(gaussian, in, 2): std sqrt(2 / fan_in)
    conv = model[0].weight.detach()      # the same storage, updated in place
    assert float(conv.std()) == pytest.approx(math.sqrt(2 / (64 * 9)), rel=0.03)
    assert not model[0].bias.detach().any() and not model[3].bias.detach().any()
    assert torch.equal(model[1].weight, torch.ones(128)) and torch.equal(model[1].running_var, torch.ones(128))
    initializers.initialize(model, "xavier", "resnet")     # uniform, +- sqrt(3 / ((fan_in + fan_out) / 2))
    bound = math.sqrt(3 / ((64 * 9 + 128 * 9) / 2))
    assert float(conv.abs().max()) <= bound and float(conv.abs().max()) > 0.95 * bound
    initializers.initialize(model, "default", "vgg16")      # Xavier() for vgg
    assert float(conv.abs().max()) <= bound
    initializers.initialize(model, "orthogonal")
    flat = model[3].weight.detach().double()                         # (10, 512): orthonormal rows x 1.414
    torch.testing.assert_close(flat @ flat.T, 1.414 ** 2 * torch.eye(10, dtype=torch.float64), atol=1e-5, rtol=0)
    initializers.initialize(model, "one")
    assert torch.equal(model[3].weight.detach(), torch.ones(10, 512)) and not model[3].bias.detach().any()


# ---------------------------------------------------------------- one process, the 'local' store

def test_float16_trains_in_mixed_precision():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4))
    seen = []
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x = torch.randn(64, 3, 8, 8)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()   # learnable labels
    args = fit_args("--dtype", "float16", "--num-epochs", "6", "--lr", "0.1", "--lr-step-epochs", "",
                    "--disp-batches", "0")
    before = model[3].weight.detach().clone()
    kv = kvstore.create("local")
    trainer = kvtorch.Trainer(model.parameters(), kv, common.make_optimizer(args, 4))
    try:
        acc = common.train_epochs(args, kv, model, trainer, lambda e, r, n: ((x[i:i + 16], y[i:i + 16])
                                  for i in range(0, 64, 16)), lambda: [(x, y)], torch.device("cpu"))
    finally:
        trainer.close()
        kv.close()
    assert seen and set(seen) == {torch.float16}                   # every forward, train and eval
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(before, model[3].weight) and torch.isfinite(model[3].weight).all()
    assert acc > 0.5                                                # it learned (chance: 0.25)


def test_test_io_reads_without_training(tiny_cifar, caplog):
    caplog.set_level(logging.INFO, logger="fit")
    assert train_cifar10.main(small(tiny_cifar, "--test-io", "1", "--disp-batches", "2")) is None
    text = caplog.text
    assert re.search(r"Batch \[1\]\tSpeed: [\d.]+ samples/sec", text) and "Batch [3]" in text
    assert "Train-accuracy" not in text and "Epoch[" not in text


def test_save_period_and_monitor(tiny_cifar, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fit")
    train_cifar10.main(small(tiny_cifar, "--num-epochs", "3", "--save-period", "2", "--model-prefix",
                             str(tmp_path / "m"), "--monitor", "3", "--top-k", "3"))
    assert sorted(os.listdir(tmp_path)) == ["m-0002.params", "m-0002.states"]
    text = caplog.text
    # every 3rd batch from the first (batches 1, 4, 7, ... counted over the run): outputs and parameters
    steps = sorted({int(s) for s in re.findall(r"Batch: +(\d+) ", text)})
    assert steps == [1, 4, 7, 10]
    assert re.search(r"Batch:       1 1_output {23}[\d.e+-]+", text)
    assert re.search(r"Batch:       1 1\.weight {23}[\d.e+-]+", text)
    assert "Epoch[2] Train-top_k_accuracy_3=" in text and "Epoch[2] Validation-top_k_accuracy_3=" in text


def test_benchmark_runs_synthetic_data_without_validation(caplog):
    caplog.set_level(logging.INFO, logger="fit")
    result = train_cifar10.main(["--kv-store", "local", "--benchmark", "1", "--network", "mlp", "--num-examples",
                                 "48", "--batch-size", "16", "--disp-batches", "1", "--num-epochs", "1",
                                 "--data-dir", "/nonexistent"])
    assert math.isnan(result)
    assert "Epoch[0] Batch [3]" in caplog.text and "Validation" not in caplog.text


def test_resnet_has_mxnets_batchnorm_of_the_input():
    from models import DataBatchNorm, get_network
    net = get_network("resnet", 10, 20, (3, 28, 28), data_bn=True)
    first = net.features[0]
    assert isinstance(first, DataBatchNorm)
    assert sum(p.numel() for p in net.parameters()) == 3 + sum(
        p.numel() for p in get_network("resnet", 10, 20, (3, 28, 28)).parameters())   # the shift only
    x = torch.randn(32, 3, 8, 8) * 50 + torch.tensor([100.0, -20.0, 7.0])[None, :, None, None]
    with torch.no_grad():
        first.bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
        out = first(x)                          # training mode: the batch's statistics, scale 1
    torch.testing.assert_close(out.mean((0, 2, 3)), torch.tensor([1.0, 2.0, 3.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.std((0, 2, 3), correction=0), torch.ones(3), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="data_bn"):
        get_network("mlp", data_bn=True)


def test_profile_suffixes_in_one_process(tiny_cifar, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fit")
    train_cifar10.main(small(tiny_cifar, "--profile-worker-suffix", str(tmp_path / "trace.json"),
                             "--profile-server-suffix", "srv.json"))
    with open(tmp_path / "trace.json") as f:
        assert '"traceEvents"' in f.read()                  # a Chrome trace, one worker: no rank prefix
    assert "the 'local' store has no servers to profile" in caplog.text


def test_several_gpus_wrap_the_model_in_data_parallel():
    model = torch.nn.Linear(2, 2)
    assert common.on_gpus(model, argparse.Namespace(gpus="0")) is model
    assert common.on_gpus(model, argparse.Namespace(gpus="")) is model
    wrapped = common.on_gpus(model, argparse.Namespace(gpus="0,1"))
    assert isinstance(wrapped, torch.nn.DataParallel) and wrapped.module is model

"""The examples' modern-recipe flags (ours, beyond MXNet's fit.py): --lr-schedule
cosine, --lr-warmup-epochs and --no-bias-decay, run by the servers (issue 44: "no
weight decay on biases, warm-up and a cosine schedule ... on the servers from the
torch Trainer and from train_cifar10.py's flags")."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import common  # noqa: E402
import train_cifar10  # noqa: E402
from tiny_cifar import write_tiny_cifar  # noqa: E402

import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def fit_args(*argv):
    return train_cifar10.build_parser().parse_args(list(argv))


def test_cosine_with_a_warm_up_ramps_from_zero_then_decays_to_zero():
    opt = common.make_optimizer(fit_args("--lr", "0.4", "--lr-schedule", "cosine", "--lr-warmup-epochs", "1",
                                         "--num-epochs", "4"), 10)
    sched = opt.lr_scheduler
    assert isinstance(sched, kvstore.optimizer.CosineScheduler)
    got = [sched(t) for t in (1, 5, 10, 25, 40)]          # t: the 1-based update count
    want = [0.04, 0.2, 0.4, 0.4 * (1 + math.cos(math.pi * 15 / 30)) / 2, 0.0]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_a_warm_up_before_fit_pys_step_schedule_or_none():
    sched = common.make_optimizer(fit_args("--lr", "0.1", "--lr-warmup-epochs", "2", "--lr-step-epochs", "3",
                                           "--lr-factor", "0.5", "--num-epochs", "5"), 10).lr_scheduler
    np.testing.assert_allclose([sched(t) for t in (1, 10, 20, 30, 31)], [0.005, 0.05, 0.1, 0.1, 0.05])
    flat = common.make_optimizer(fit_args("--lr", "0.1", "--lr-warmup-epochs", "1", "--lr-factor", "1"),
                                 10).lr_scheduler
    np.testing.assert_allclose([flat(t) for t in (1, 5, 10, 1000)], [0.01, 0.05, 0.1, 0.1])


@pytest.mark.parametrize("extra, says", [
    (["--lr-schedule", "linear"], "--lr-schedule 'linear': expected step or cosine"),
    (["--lr-warmup-epochs", "-1"], "--lr-warmup-epochs must be >= 0"),
    (["--lr-warmup-epochs", "1", "--lr-step-epochs", "pow2"], "use --lr-schedule cosine"),
])
def test_bad_values_are_usage_errors(extra, says):
    with pytest.raises(common.UsageError, match=re.escape(says)):
        common.check_fit_args(fit_args(*extra))


def test_no_bias_decay_leaves_the_one_dimensional_parameters_alone_on_the_servers(make_cluster):
    """SGD with wd 0.5 and a zero gradient: each weight shrinks by lr x wd on the
    servers, and the biases and the norm's parameters do not move."""
    def job(kv):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        no_decay = [n for n, p in model.named_parameters() if p.ndim == 1]
        args = fit_args("--lr", "0.1", "--wd", "0.5", "--mom", "0", "--lr-factor", "1")
        trainer = kvtorch.Trainer(model.named_parameters(), kv, common.make_optimizer(args, 10, kv, no_decay))
        (model(torch.ones(2, 4)) * 0).sum().backward()
        trainer.step()
        return no_decay, {n: (before[n], p.detach().clone()) for n, p in model.named_parameters()}

    (no_decay, params), _ = make_cluster(2, 1).run(job)
    assert no_decay == ["0.bias", "1.weight", "1.bias"]
    for name, (old, new) in params.items():
        factor = 1.0 if name in no_decay else 1 - 0.1 * 0.5
        torch.testing.assert_close(new, old * factor, rtol=1e-6, atol=1e-7, msg=name)


def test_train_cifar10_runs_the_recipe_on_the_servers(tmp_path):
    """A real job: 2 workers, 2 servers, cosine with a warm-up and no decay on biases."""
    write_tiny_cifar(tmp_path)
    env = {**os.environ, "PYTHONPATH": ROOT, "KVSTORE_HEARTBEAT_TIMEOUT": "20"}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable,
                        "examples/train_cifar10.py", "--kv-store", "dist_sync", "--network", "mlp",
                        "--data-train", str(tmp_path), "--num-examples", "64", "--batch-size", "8",
                        "--num-epochs", "2", "--wd", "1e-4", "--lr-schedule", "cosine", "--lr-warmup-epochs", "1",
                        "--no-bias-decay"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    for w in (0, 1):
        assert re.search(rf"\[worker:{w}\] .*no weight decay on 3 biases and normalisation parameters", out)
        assert re.search(rf"\[worker:{w}\] .*Epoch\[1\] Validation-accuracy=[\d.]+", out)

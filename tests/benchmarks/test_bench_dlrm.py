"""benchmarks/dlrm at a tiny size: our contender runs for real (tracker.local, its
servers, its workers) and trains the DLRM it claims to: its loss curve is the one a
single process computes with plain torch (the whole tables in an EmbeddingBag, the
global batch, torch SGD), and the loss falls. TorchRec runs too when
benchmarks/.venv-torchrec exists (CI has none: that part is skipped, saying why),
and must report the same curve. Never asserts on speed."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.dlrm import data  # noqa: E402
from benchmarks.dlrm.model import DLRM, init_dense, loss_fn  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
VENV = os.path.join(ROOT, "benchmarks", ".venv-torchrec")
SMALL = ["--tables", "3x2000,1000", "--dim", "8", "--batch", "256", "--pooling", "2", "--bottom", "16",
         "--top", "16", "--steps", "9", "--warmup", "1", "--lr", "0.5", "--workers", "2"]


def bench(out_dir, *args):
    p = subprocess.run([sys.executable, "-m", "benchmarks.dlrm.run", "--out-dir", str(out_dir), *SMALL, *args],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=360)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out_dir / "dlrm.json") as f:
        return p.stdout, json.load(f)


def reference_losses(cfg: data.Config, workers: int, steps: int, lr: float) -> list[float]:
    """One process, plain torch: the global batch (every worker's part), the tables as
    one EmbeddingBag weight with the shared initial values, SGD on everything."""
    torch.manual_seed(0)

    class Tables(torch.nn.Module):
        def __init__(self):
            super().__init__()
            rows = np.arange(cfg.total_rows)
            self.weight = torch.nn.Parameter(torch.from_numpy(data.init_rows(rows, cfg.dim, cfg.init_scale,
                                                                            cfg.seed)))
            self.offsets = torch.from_numpy(cfg.offsets[:-1])

        def forward(self, ids):
            t, b, length = ids.shape
            flat = (ids + self.offsets.view(t, 1, 1)).reshape(-1)
            bags = torch.nn.functional.embedding_bag(flat, self.weight, torch.arange(0, t * b * length, length),
                                                     mode="sum")
            return bags.view(t, b, -1).transpose(0, 1)

    model = DLRM(Tables(), len(cfg.tables), cfg.dim, cfg.n_dense, [16], [16])
    init_dense(model, cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        parts = [data.batch(cfg, r, i) for r in range(workers)]
        dense = torch.from_numpy(np.concatenate([p.dense for p in parts]))
        ids = torch.from_numpy(np.concatenate([p.ids for p in parts], axis=1))
        labels = torch.from_numpy(np.concatenate([p.labels for p in parts]))
        opt.zero_grad()
        loss = loss_fn(model(dense, ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_tables_init_as_our_servers_do():
    from kvstore import RowInit
    rows = np.array([0, 1, 1999, 5000, 6999])
    ours = np.zeros((len(rows), 8), np.float32)
    RowInit("uniform", 0.05, (7000, 8), "float32", seed=3).fill(ours, rows)
    assert np.array_equal(ours, data.init_rows(rows, 8, 0.05, 3))


def check_ours(ours, want):
    assert len(ours["losses"]) == 10
    np.testing.assert_allclose(ours["losses"], want, rtol=0, atol=1e-4)
    assert ours["losses"][-1] < ours["losses"][0] - 0.05           # it learns (0.712 -> 0.614)
    for field in ("steps_per_s", "tcp_bytes_per_step", "comm_bytes_per_step", "worker_peak_rss_mb"):
        assert ours[field] > 0, field
    assert len(ours["server_peak_rss_mb"]) == 2 and min(ours["server_peak_rss_mb"]) > 0
    # the store's own count and the sockets' agree (headers of TCP aside)
    assert ours["comm_bytes_per_step"] <= ours["tcp_bytes_per_step"] < 1.1 * ours["comm_bytes_per_step"]


CFG = data.Config(tables=(2000, 2000, 2000, 1000), dim=8, batch=256, pooling=2)


def test_ours_trains_the_model_one_process_trains(tmp_path):
    printed, got = bench(tmp_path, "--contenders", "ours")
    assert printed.startswith((tmp_path / "dlrm.md").read_text())
    (ours,) = got["rows"]
    check_ours(ours, reference_losses(CFG, workers=2, steps=10, lr=0.5))


def test_torchrec_trains_the_same_model_as_ours(tmp_path):
    if not os.path.exists(os.path.join(VENV, "bin", "python")):
        pytest.skip(f"{VENV} does not exist (CI has no TorchRec venv; docs/performance.md 9.2 says how to make it)")
    _, got = bench(tmp_path, "--contenders", "ours,torchrec")
    rows = {r["contender"]: r for r in got["rows"]}
    want = reference_losses(CFG, workers=2, steps=10, lr=0.5)
    check_ours(rows["ours"], want)
    trec = rows["torchrec"]
    assert abs(trec["losses"][0] - rows["ours"]["losses"][0]) < 1e-5
    np.testing.assert_allclose(trec["losses"], want, rtol=0, atol=1e-4)
    assert got["compare"]["2"]["same_loss"] is True
    assert trec["plan"] and trec["torchrec"] != "?"

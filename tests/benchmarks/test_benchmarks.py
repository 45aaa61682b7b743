"""The benchmark's own pieces at tiny size (benchmarks/pushpull/run.py). Never asserts
on speed: timings are only checked to exist."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.harness import common  # noqa: E402
from benchmarks.pushpull import report  # noqa: E402
from benchmarks.harness.contenders import ours  # noqa: E402
from benchmarks.harness.contenders.base import RunConfig  # noqa: E402
from benchmarks.harness.resnet50_shapes import (RESNET50_TENSORS, RESNET50_VALUES, model_shapes,  # noqa: E402
                                        resnet50_shapes)


def test_resnet50_shapes_match_torchvision_totals():
    named = resnet50_shapes()
    assert len(named) == RESNET50_TENSORS == 161
    assert sum(math.prod(s) for _, s in named) == RESNET50_VALUES == 25_557_032
    assert named[0] == ("conv1.weight", (64, 3, 7, 7))
    assert named[-2:] == [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    assert sum(1 for _, s in named if math.prod(s) * 4 < 64 << 10) == 109
    assert len({n for n, _ in named}) == 161


def test_resnet50_shapes_equal_torch_model_when_torch_is_there():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Bottleneck(nn.Module):  # torchvision's block, written out
        def __init__(self, inplanes, planes, downsample):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            if downsample:
                self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, bias=False),
                                                nn.BatchNorm2d(planes * 4))

    net = nn.Module()
    net.conv1 = nn.Conv2d(3, 64, 7, bias=False)
    net.bn1 = nn.BatchNorm2d(64)
    inplanes = 64
    for i, (blocks, planes) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        layer = nn.Sequential(*[Bottleneck(inplanes if b == 0 else planes * 4, planes, b == 0)
                                for b in range(blocks)])
        setattr(net, f"layer{i}", layer)
        inplanes = planes * 4
    net.fc = nn.Linear(2048, 1000)
    got = [(n, tuple(p.shape)) for n, p in net.named_parameters()]
    assert got == resnet50_shapes()


def test_verify_accepts_the_sum_and_rejects_stale_or_partial_results():
    shapes = model_shapes("tiny")
    outs = [np.full(s, common.expected_sum(2, k, 5), np.float32) for k, s in enumerate(shapes)]
    common.verify(outs, 2, 5)
    with pytest.raises(common.WrongResult):
        common.verify(outs, 2, 6)  # a previous iteration's result
    outs[-2].reshape(-1)[12345] = 0.0  # one element wrong, not sampled: the total catches it
    with pytest.raises(common.WrongResult, match="total sum"):
        common.verify(outs, 2, 5)
    # a compressed exchange has its own expected value (2bit with t = 0.5: W * t)
    from benchmarks.harness.contenders.ours_worker import COMPRESSION
    _, expected = COMPRESSION["pushpull_2bit"]
    halves = [np.full(s, 1.0, np.float32) for s in shapes]
    common.verify(halves, 2, 5, expected=expected)
    with pytest.raises(common.WrongResult):
        common.verify(outs, 2, 5, expected=expected)


def test_our_contender_runs_through_the_launcher_and_checks_the_sum(tmp_path):
    cfg = RunConfig(workers=2, servers=1, model="tiny", iters=2, warmup=1, latency_iters=3,
                    latency_sizes=(1, 1000), async_pushes=5, async_reps=1, transports=("tcp",),
                    work_dir=str(tmp_path), timeout=60)
    rows = ours.run(cfg, 0)
    kinds = {(r["kind"], r["variant"]) for r in rows}
    assert ("exchange", "tcp: pushpull") in kinds and ("exchange", "tcp: push, then pull") in kinds
    assert ("latency", "4000 B") in kinds
    assert any(k == "async" for k, _ in kinds)
    for r in rows:
        assert r["samples"] and all(x > 0 for x in r["samples"])
    # compression rows are their own kind (a lossy exchange never counts for the targets),
    # each checked against its exact compressed sum by the workers, with bytes on the wire
    by_variant = {r["variant"]: r for r in rows if r["kind"] in ("exchange", "compression")}
    plain = by_variant["tcp: pushpull"]
    for kind, ratio in (("2bit", 16), ("1bit", 32), ("fp16", 2)):
        row = by_variant[f"tcp: pushpull, {kind} compression"]
        assert row["kind"] == "compression"
        # payload shrinks by `ratio`; headers and the exact pull stay
        assert row["bytes_sent"] < plain["bytes_sent"] / ratio * 1.5
        assert row["bytes_received"] == plain["bytes_received"]
    summary = report.summarise(rows, cfg)
    assert not any("compression" in (t["numerator"] or "") for t in summary["targets"])
    data = {"summary": summary, "config": cfg.__dict__, "machine": common.machine(),
            "versions": {}, "started": "", "finished": "", "skipped": {}, "failures": []}
    text = report.markdown(data)
    assert "tcp: pushpull" in text and "| target |" in text
    assert "| tcp | 2bit |" in text and "| tcp | none |" in text


def test_emulated_hosts_use_shared_memory_within_a_host_and_tcp_between(tmp_path):
    cfg = RunConfig(workers=2, servers=2, model="tiny", iters=2, warmup=1, latency_iters=0,
                    async_pushes=0, compression=(), transports=("hosts",), work_dir=str(tmp_path),
                    timeout=60)
    assert ours.TRANSPORTS["hosts"].for_job(cfg).expected_kinds(2) == ["shm", "tcp"]
    rows = ours.run(cfg, 0)     # fails unless rank 0's client used exactly these
    assert {r["variant"] for r in rows} == {"hosts: push, then pull", "hosts: pushpull",
                                             "hosts: pushpull, gradients from kv.empty()"}
    summary = report.summarise(rows, cfg)
    assert [t["target"] for t in summary["targets"]
            if t["numerator"] and t["numerator"].startswith("ours hosts")][:1] == [
        "(the same between emulated hosts, one server per host: tcp between hosts only)"]


def test_unavailable_transports_are_skipped_with_a_reason(tmp_path):
    cfg = RunConfig(transports=("tcp", "ipc", "shm"), work_dir=str(tmp_path))
    usable, skipped = ours.available_transports(cfg)
    assert "tcp" in [t.name for t in usable]
    for line in skipped:
        assert "transport" in line


def test_cli_help_lists_the_contenders():
    from benchmarks.pushpull.run import main
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for word in ("--workers", "--servers", "--setup-peers", "--launches", "--profile"):
        assert word in result.output


def test_cli_rejects_an_unknown_contender():
    from benchmarks.pushpull.run import main
    result = CliRunner().invoke(main, ["--contenders", "ours,horovod"])
    assert result.exit_code != 0 and "horovod" in result.output


def test_compress_benchmark_checks_every_type_against_a_git_version():
    from benchmarks.compress import run as compress
    result = CliRunner().invoke(compress.main, ["--size", "1001", "--repeats", "1", "--before", "HEAD"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split(" | ")[0:2] for r in rows] == [["| 2bit", "today"], ["| 2bit", "HEAD"], ["| 1bit", "today"],
                                                   ["| 1bit", "HEAD"], ["| fp16", "today"], ["| fp16", "HEAD"]]


def test_before_runs_our_contender_from_a_worktree_of_a_commit(tmp_path):
    """--before REF: the same contender, as commit REF has it, in a temporary worktree
    (removed afterwards); a ref that names no commit is a clean error."""
    cfg = RunConfig(workers=2, servers=1, model="tiny", iters=2, warmup=1, latency_iters=2,
                    latency_sizes=(1,), async_pushes=3, async_reps=1, transports=("tcp",),
                    work_dir=str(tmp_path), timeout=60)
    with ours.worktree("HEAD") as (tree, commit):
        assert os.path.isfile(os.path.join(tree, "kvstore", "__init__.py")) and commit
        rows = ours.run_in_tree(tree, "ours@HEAD", cfg, 0)
    assert not os.path.exists(tree)
    assert rows and all(r["contender"].startswith("ours@HEAD") or r["kind"] == "compression" for r in rows)
    assert any(r["kind"] == "exchange" and r["samples"] for r in rows)
    with pytest.raises(ours.Failed, match="no-such-ref"):
        with ours.worktree("no-such-ref"):
            pass

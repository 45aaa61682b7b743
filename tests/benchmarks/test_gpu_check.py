"""The GPU benchmark's server rounds (benchmarks/gpu_check/run.py) run in CI on the host
backend, so a renamed method or a changed signature of the server state fails
here, not on the next GPU loan (issue 29, defect 2)."""

import numpy as np
import pytest

from benchmarks.gpu_check.run import server_rounds
from kvstore import optimizer as opt
from kvstore.server.backend import HostBackend


@pytest.mark.parametrize("optimizer", [None, opt.SGD(learning_rate=0.1, momentum=0.9)], ids=["sum", "sgd"])
def test_one_benchmark_round_applies_one_sync_round_on_every_chunk(optimizer):
    state, one_round = server_rounds(HostBackend(), np, n=1000, count=3, workers=2, optimizer=optimizer)
    one_round()
    one_round()
    total = 0.5 + 1.0                                  # worker 0 pushes 0.5, worker 1 pushes 1.0
    if optimizer is None:
        want = total                                   # no optimizer: the round's sum is assigned
    else:
        mom = -0.1 * total
        mom = 0.9 * mom - 0.1 * total
        want = -0.1 * total + mom
    for i in range(3):
        np.testing.assert_allclose(state.chunks[("k", i)].value, want, rtol=1e-6)
        assert not state.chunks[("k", i)].rounds            # nothing left waiting


def test_the_multi_tensor_rounds_run_each_push_as_one_event_on_the_host_device():
    """``batched``: each worker's push one event, as Sync.join runs it; the GPU server's
    code path (the host device) updates every chunk of the round in one group."""
    from kvstore.devices import HostDevice
    from kvstore.server.backend import DeviceBackend
    sgd = opt.SGD(learning_rate=0.1, momentum=0.9)
    backend = DeviceBackend(HostDevice())
    state, one_round = server_rounds(backend, backend.xp, n=1000, count=3, workers=2, optimizer=sgd, batched=True)
    want, per_chunk = server_rounds(HostBackend(), np, n=1000, count=3, workers=2, optimizer=sgd)
    for _ in range(2):
        one_round()
        per_chunk()
    assert (backend.updates.launches, backend.updates.updates) == (2, 6)
    for i in range(3):
        np.testing.assert_array_equal(state.chunks[("k", i)].value, want.chunks[("k", i)].value)
        assert not state.chunks[("k", i)].rounds


def test_sections_are_isolated_and_a_budget_runs_what_fits():
    """--budget: the sections in order while their expected time fits; a failing one
    is recorded with its error and the next one runs; every result is saved as it comes."""
    from benchmarks.gpu_check.run import report, run_sections
    now = [0.0]
    saved = []

    def step(seconds, fail=False):
        def run(left):
            now[0] += seconds
            if fail:
                raise RuntimeError("kernel launch failed")
            return {"took": seconds, "left": left}
        return run
    steps = {"pytest": step(100), "aggregation": step(10, fail=True), "exchange": step(50), "train": step(50)}
    results = run_sections(steps, list(steps), budget=200, save=lambda r: saved.append(dict(r)),
                           clock=lambda: now[0], expected={"pytest": 120, "aggregation": 20, "exchange": 60,
                                                           "train": 60})
    assert results["pytest"] == {"took": 100, "left": 200}
    assert results["aggregation"]["error"] == "RuntimeError: kernel launch failed"
    assert results["exchange"] == {"took": 50, "left": 90}           # 90 s left >= 60 expected
    assert results["train"]["skipped"].startswith("budget: 40 s left of 200 s, train needs about 60 s")
    assert [list(r) for r in saved] == [["pytest"], ["pytest", "aggregation"],
                                        ["pytest", "aggregation", "exchange"],
                                        ["pytest", "aggregation", "exchange", "train"]]
    info = {k: "x" for k in ("gpu", "when", "commit", "driver", "cuda_runtime", "torch", "torch_cuda", "cupy",
                             "numpy", "python", "gpus")}
    text = report({"info": info, "aggregation": results["aggregation"], "train": results["train"]})
    assert "## aggregation: failed: RuntimeError: kernel launch failed" in text
    assert "## train: skipped (budget: 40 s left" in text


def test_the_report_shows_pytests_summary_when_some_gpu_tests_were_skipped():
    """pytest's result carries the list of skipped tests under "skipped": that is a
    summary to print, not a section that was skipped (the H100 run of 2026-11-27 printed
    "## pytest: skipped" over 168 passed tests)."""
    from benchmarks.gpu_check.run import report
    info = {k: "x" for k in ("gpu", "when", "commit", "driver", "cuda_runtime", "torch", "torch_cuda", "cupy",
                             "numpy", "python", "gpus")}
    pytest = {"returncode": 0, "summary": "168 passed, 5 skipped", "failures": [],
              "skipped": ["SKIPPED [5] tests/api/test_device.py:458: needs 2 GPUs, found 1"]}
    text = report({"info": info, "pytest": pytest})
    assert "## pytest: skipped" not in text
    assert "`168 passed, 5 skipped` (exit 0)" in text
    assert "- SKIPPED [5] tests/api/test_device.py:458: needs 2 GPUs, found 1" in text


def test_the_exchange_phases_run_on_the_host_device():
    """benchmarks/gpu_check/phases.py, which the GPU run uses to split an exchange into its
    copies and the server's round, runs on the device layer's host implementation,
    so a renamed server method fails here rather than on the next GPU loan."""
    from benchmarks.gpu_check.phases import phases, report
    from kvstore.devices import HostAccelerators, HostDevice
    from kvstore.devices.host_sharing import HostSharing
    acc = HostAccelerators(1, sharing=HostSharing("phases-test"))
    try:
        copies = acc.batches
        result = phases(HostDevice(), acc, reps=2, chunk_bytes=1024, shapes=[(64, 3, 3), (10,), (1000, 2)],
                        bucket_values=600)
    finally:
        acc.sharing.close()
    assert result["tensors"] == 3 and result["layouts"] == ["3 keys", "2 buckets"]   # [2000] and [10 + 576]
    rows = {(r["path"], r["phase"]) for r in result["rows"]}
    assert ("both", "server round, 3 keys (sum of 2 + sgd momentum, 12 chunks)") in rows   # 1 + 1 + 8 x 1 KB, ...
    assert ("both", "server round, 2 buckets (sum of 2 + sgd momentum, 11 chunks)") in rows   # 8 + 3
    assert ("cuda_ipc", "worker stage (slots, one batched copy, sync), 2 buckets") in rows
    assert ("host", "worker pack") in rows and len(rows) == 8 + 2 + 2 * 3
    assert all(r["ms"] > 0 for r in result["rows"])
    assert acc.batches > copies          # the worker's steps ran through the batched copies
    assert "| host | worker d2h -> shm |" in "\n".join(report(result))


@pytest.mark.slow
@pytest.mark.parametrize("contender, transports", [
    ("gloo", "-"),
    ("ours cpu servers", "shm"),
    ("ours cpu servers, flat buckets", "shm"),
    ("ours cpu servers, one key", "shm")])
def test_the_exchange_jobs_run_on_the_cpu(tmp_path, contender, transports):
    """gpu_check's exchange section (run.job over benchmarks/gpu_check/worker.py) with
    CPU tensors (--device cpu): every contender's processes start, exchange
    ResNet-50's values in their layout and check every sum, so a broken worker script
    fails here and not in a GPU loan's minutes."""
    from benchmarks.gpu_check.run import job
    result = job("exchange", contender, str(tmp_path / "out.json"), 120,
                 ("--device", "cpu", "--iters", "1", "--warmup", "0"))
    assert "failed" not in result, result.get("tail")
    assert result["samples"] == 1 and result["median_ms"] > 0 and result["transports"] == transports

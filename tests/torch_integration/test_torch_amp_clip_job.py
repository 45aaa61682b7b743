"""A real 2-worker, 2-server job (``python -m tracker.local -n 2 -s 2``,
tests/scripts/amp_clip_job.py): bfloat16 autocast, a ``torch.amp.GradScaler`` and
global-norm clipping, with an inf injected into worker 1's loss at one step, run
seven ways (the script's docstring lists them): DDP's loop with the workers updating,
the Trainer's options (``clip_grad_norm=``, ``grad_scaler=``) in both modes, and DDP's
own loop (``scaler.unscale_(trainer)``, ``trainer.clip_grad_norm_``,
``scaler.step(trainer)``, with and without the clipping) in both modes: with the
servers updating they unscale, clip by the whole model's norm over both servers, and
skip the overflowed step, the round held open between backward and step. Every run
gives the same bits as its DDP loop, every worker's scale is the same after every
step, the injected step was skipped (the scale backed off there), clipping was active,
and ``trainer.clip_grad_norm_`` returned torch's norms."""

import os

import pytest

torch = pytest.importorskip("torch")

from services import import_script, run_local_job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "amp_clip_job.py")
DEADLINE = 120      # seconds for the job (4 processes importing torch on 2 cores, 3 short runs)
RUNS = ("ddp", "workers", "ddp-method", "ddp-noclip", "servers", "servers-ddp", "servers-noclip")
# each run and the DDP loop it must equal bit for bit
SAME_AS = [("workers", "ddp"), ("servers", "ddp"), ("ddp-method", "ddp"), ("servers-ddp", "ddp"),
           ("servers-noclip", "ddp-noclip")]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("amp_clip")
    out = folder / "result.pt"
    run_local_job(SCRIPT, str(out), cwd=folder, timeout=DEADLINE)
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1)]


def _script():
    return import_script("amp_clip_job_settings")


@pytest.mark.parametrize("how,ddp", SAME_AS)
def test_the_trainers_clipping_and_scaler_give_ddps_weights_bit_for_bit(job, how, ddp):
    for rank in (0, 1):
        for a, b in zip(job[rank][ddp]["weights"], job[rank][how]["weights"]):
            assert torch.equal(a, b), (rank, how)


@pytest.mark.parametrize("how", ["ddp-method", "servers-ddp"])
def test_the_trainers_clip_grad_norm_returns_torchs_total_norm_on_every_worker(job, how):
    """FSDP's method: the servers' norm (from their phase 1) is torch's, bit for bit,
    nan or inf at the overflowed step as torch's; the same on both workers."""
    want = [repr(n) for n in job[0]["ddp"]["norms"]]
    assert [repr(n) for n in job[0][how]["norms"]] == want
    assert [repr(n) for n in job[1][how]["norms"]] == want


def test_the_runs_without_clipping_differ_from_those_with_it(job):
    """(The no-clip runs would not catch a clip wrongly applied or dropped otherwise.)"""
    assert not all(torch.equal(a, b) for a, b in zip(job[0]["ddp"]["weights"], job[0]["ddp-noclip"]["weights"]))


@pytest.mark.parametrize("how", RUNS)
def test_the_overflow_on_one_worker_is_skipped_by_both_and_the_scales_stay_equal(job, how):
    s = _script()
    scales = job[0][how]["scales"]
    assert scales == job[1][how]["scales"]
    # growth_interval=3: grown after steps 0-2, backed off by the inf at INF_STEP, grown again 3 steps on
    assert scales[s.INF_STEP - 1] == 2 * scales[0] and scales[s.INF_STEP] == scales[s.INF_STEP - 1] / 2
    assert scales[s.INF_STEP + 3] == 2 * scales[s.INF_STEP]


def test_clipping_was_active_and_the_weights_moved(job):
    s = _script()
    norms = job[0]["ddp"]["norms"]
    finite = [n for n in norms if n == n and n != float("inf")]
    assert len(finite) == s.STEPS - 1 and all(n > s.MAX_NORM for n in finite)   # every finite step clipped
    start = s.model()
    assert not any(torch.equal(a, b.detach()) for a, b in zip(job[0]["servers"]["weights"], start.parameters()))

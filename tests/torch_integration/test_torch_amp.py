"""kvstore.torch.Trainer with torch's loss scaling (``torch.amp.GradScaler``) and
MXNet Gluon's split step (``allreduce_grads()``, then ``update()``): W workers train
like one process on batches of W*b, a step whose averaged gradient overflowed is
skipped by every worker alike, and gradients can be unscaled and clipped between
the exchange and the update."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import kvstore.torch as kvtorch  # noqa: E402
from kvstore.errors import ArgumentTypeError, InvalidArgumentError  # noqa: E402
from test_torch_trainer import B, W, assert_same, batches, make_model, run_dist  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                                reason="torch.amp.GradScaler is not in this torch")

OVERFLOW_STEP = 2     # the step whose gradient is made infinite (on rank 1 only, in the jobs)
INIT_SCALE = 2.0 ** 12


def scaler():
    # growth_interval=2: the scale also grows during the 4 steps, not only halves
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


def poison(model):
    """Make the first layer's gradient infinite (one process: after backward)."""
    next(model.parameters()).grad.fill_(float("inf"))


def overflow_in_backward(model, loss):
    """``loss.backward()`` in which the first layer's gradient overflows (infinite):
    on a worker, whose exchange finishes when backward ends (as DDP's), an overflow
    must happen in backward to reach the others, as a real one does."""
    hook = next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        loss.backward()
    finally:
        hook.remove()


def reference(clip=None):
    """One process on batches of W*b with the same scaler; its averaged gradient
    overflows at OVERFLOW_STEP (in the jobs, one worker's overflow makes the sum
    infinite). Returns (parameters, the scale after every step)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    s, scales = scaler(), []
    for step, (x, y) in enumerate(batches()):
        opt.zero_grad()
        s.scale(F.cross_entropy(model(x), y)).backward()
        if step == OVERFLOW_STEP:
            poison(model)
        if clip is not None:
            s.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        s.step(opt)
        s.update()
        scales.append(s.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales


def job_loop(model, trainer, rank, size, clip=None):
    """The loop a user writes with a scaler; rank 1's gradient overflows once."""
    s, scales = scaler(), []
    per = W * B // size
    for step, (x, y) in enumerate(batches()):
        trainer.zero_grad()
        loss = s.scale(F.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]))
        if step == OVERFLOW_STEP and rank == 1:
            overflow_in_backward(model, loss)
        else:
            loss.backward()
        if clip is None:
            trainer.step(scaler=s)
        else:
            trainer.allreduce_grads()
            s.unscale_(trainer.torch_optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            trainer.update(s)
        s.update()
        scales.append(s.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales


@pytest.mark.parametrize("overlap", [True, False])
def test_a_scaler_steps_like_one_process_and_every_worker_skips_the_overflow(make_cluster, overlap):
    want, want_scales = reference()
    # the scale grew after 2 good steps, and halved at the overflow, which was skipped
    assert want_scales == [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE]
    results = run_dist(make_cluster, lambda m: (
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), {"overlap": overlap}),
        loop=job_loop)
    for got, scales in results:
        assert scales == want_scales
        assert_same(got, want)
        assert all(torch.isfinite(p).all() for p in got)


def test_unscale_and_clip_between_the_exchange_and_the_update(make_cluster):
    want, want_scales = reference(clip=0.05)
    results = run_dist(make_cluster, lambda m: (
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), {}),
        loop=lambda *a: job_loop(*a, clip=0.05))
    for got, scales in results:
        assert scales == want_scales
        assert_same(got, want)
    # clipping changed the result (the test would not notice a skipped clip otherwise)
    unclipped, _ = reference()
    assert any(not torch.allclose(a, b) for a, b in zip(want, unclipped))


def one_worker(make_cluster, update_on_kvstore: bool, body):
    """``body(model, trainer)`` on a 1-worker, 1-server dist_sync job; its result."""
    cluster = make_cluster(1, 1)

    def job(kv):
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  update_on_kvstore=update_on_kvstore)
        return body(model, trainer)
    return cluster.run(job)[0]


def test_a_scaler_not_given_to_a_trainer_whose_servers_update_is_refused(make_cluster):
    """The servers unscale as the backward ends: the scaler must be the Trainer's
    (``Trainer(..., grad_scaler=)``, tests/torch_integration/test_torch_amp_clip_job.py)."""
    def body(model, trainer):
        before = [p.detach().clone() for p in model.parameters()]
        s = scaler()
        s.scale(F.cross_entropy(model(torch.ones(B, 6)), torch.zeros(B, dtype=torch.long))).backward()
        with pytest.raises(InvalidArgumentError, match=r"Trainer\(\.\.\., grad_scaler=scaler\)"):
            trainer.step(scaler=s)
        with pytest.raises(InvalidArgumentError, match="call step"):
            trainer.update()
        trainer.step()              # the exchange begun in backward still completes
        return before, [p.detach().clone() for p in model.parameters()]
    before, after = one_worker(make_cluster, True, body)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_a_scaler_that_is_not_one_is_a_type_error(make_cluster):
    def body(model, trainer):
        with pytest.raises(ArgumentTypeError, match="GradScaler"):
            trainer.step(scaler=2.0)
        return True
    assert one_worker(make_cluster, False, body)


def test_bfloat16_autocast_with_a_scaler_keeps_the_workers_identical(make_cluster):
    """CPU autocast (bfloat16 compute, float32 parameters and gradients), W=2: every
    worker ends with the same finite parameters, which moved."""
    def loop(model, trainer, rank, size):
        s = scaler()
        per = W * B // size
        for x, y in batches():
            trainer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x[rank * per:(rank + 1) * per])
            s.scale(F.cross_entropy(out.float(), y[rank * per:(rank + 1) * per])).backward()
            trainer.step(scaler=s)
            s.update()
        return [p.detach().clone() for p in model.parameters()]
    start = [p.detach().clone() for p in make_model().parameters()]
    results = run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), lr=0.1), {}), loop=loop)
    for got in results:
        assert all(torch.isfinite(p).all() for p in got)
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))
    assert any(not torch.allclose(a, b) for a, b in zip(results[0], start))


@pytest.mark.gpu
def test_on_a_gpu_float16_autocast_and_an_overflow_on_one_worker(make_cluster):
    """CUDA model, float16 autocast, torch.amp.GradScaler("cuda"), W=2 dist_sync:
    the step where rank 1's gradient overflowed leaves every worker's weights as they
    were, both scalers keep the same scale, and the workers end identical and finite."""
    from kvstore.devices import gpu
    if not torch.cuda.is_available() or not gpu.available():
        pytest.skip(f"needs torch with CUDA and a usable GPU with CuPy: {gpu.reason()}")

    def loop(model, trainer, rank, size):
        s, scales, skipped = torch.amp.GradScaler("cuda", init_scale=INIT_SCALE, growth_interval=2), [], None
        per = W * B // size
        for step, (x, y) in enumerate(batches()):
            x, y = x[rank * per:(rank + 1) * per].cuda(), y[rank * per:(rank + 1) * per].cuda()
            trainer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            loss = s.scale(F.cross_entropy(out.float(), y))
            if step == OVERFLOW_STEP and rank == 1:
                overflow_in_backward(model, loss)
            else:
                loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            trainer.step(scaler=s)
            s.update()
            scales.append(s.get_scale())
            if step == OVERFLOW_STEP:
                skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return [p.detach().cpu() for p in model.parameters()], scales, skipped

    def trainer_args(model):
        model.cuda()
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {}
    results = run_dist(make_cluster, trainer_args, loop=loop)
    for got, scales, skipped in results:
        assert skipped, "the overflowed step changed the weights"
        assert scales == [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE]
        assert all(torch.isfinite(p).all() for p in got)
        assert all(torch.equal(a, b) for a, b in zip(got, results[0][0]))

"""DDP's habits with kvstore.torch.Trainer (issue 43, items 3-5): what a DDP user
writes works as it does under DDP, or is refused with an error that names the form
that works.

- clipping between ``backward()`` and ``step()`` clips the averaged gradients (DDP:
  the all-reduce finished when ``backward()`` returned), whatever the bucket layout;
  with the servers updating it is refused, naming ``trainer.allreduce_grads()``;
- ``with trainer.no_sync():`` accumulates locally, the next backward exchanges the sum;
- ``scaler.unscale_(trainer)`` / ``scaler.step(trainer)`` (and the torch optimizer's
  own ``scaler.unscale_(opt)`` / ``scaler.step(opt)``) as with a torch optimizer;
- models under 4 MiB get several buckets (sized by the model), so the exchange
  starts during backward, whatever the model's size (a request before the timeline's
  ``backward ended``).

The reference is one process on batches of W*b (what DDP computes, to float
tolerance: test_torch_trainer.py's oracle), with the same clipping, scaler or
accumulation."""

import json

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402
from kvstore.errors import ArgumentTypeError, InvalidArgumentError  # noqa: E402
from test_torch_trainer import B, SGD, W, assert_same, batches, make_model, reference_torch, run_dist  # noqa: E402
from test_torch_amp import INIT_SCALE, OVERFLOW_STEP, overflow_in_backward, reference, scaler  # noqa: E402

CLIP = 0.05     # well below the gradients' norm here: every step is clipped

# the bucket layouts the old Trainer mixed: one bucket sent in step() (the default for a
# small model then), one per parameter sent during backward, flat buckets, no overlap
LAYOUTS = [pytest.param({}, id="default"), pytest.param({"bucket_bytes": 1}, id="bucket-per-parameter"),
           pytest.param({"flat_buckets": True, "bucket_bytes": 100}, id="flat-buckets"),
           pytest.param({"overlap": False}, id="no-overlap")]


def per_worker(x, y, rank, size):
    per = W * B // size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def buckets_of(sizes, bucket_bytes):
    """How many buckets the Trainer cuts parameters of ``sizes`` bytes into (in
    backward's order, the last parameter first; a bucket ends once it holds
    ``bucket_bytes``)."""
    count, held = 0, 0
    for size in reversed(sizes):
        held += size
        if held >= bucket_bytes:
            count, held = count + 1, 0
    return count + (held > 0)


def reference_clipped(make_opt, clip=CLIP):
    """One process on W*b, clipping its gradient (DDP: the average over the workers)."""
    model = make_model()
    opt = make_opt(model.parameters())
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def clipping_loop(model, trainer, rank, size):
    """DDP's habit: backward, clip, step."""
    for x, y in batches():
        x, y = per_worker(x, y, rank, size)
        trainer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        trainer.step()
    return [p.detach().clone() for p in model.parameters()]


# -- clipping between backward() and step() -------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipping_between_backward_and_step_clips_the_average_as_ddp(make_cluster, layout):
    want = reference_clipped(lambda ps: torch.optim.SGD(ps, **SGD))
    # the clip matters: without it the weights differ
    assert any(not torch.allclose(a, b) for a, b in zip(want, reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))))
    results = run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **SGD), dict(layout)),
                       loop=clipping_loop)
    for got in results:
        assert_same(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipping_between_backward_and_step_is_refused_while_the_servers_update(make_cluster, layout):
    """The servers applied the gradients as pushed: an edit of .grad after backward
    would change nothing, so step() refuses it, naming the forms that work."""
    def loop(model, trainer, rank, size):
        x, y = per_worker(*next(batches()), rank, size)
        trainer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with pytest.raises(InvalidArgumentError, match=r"changed after backward.*allreduce_grads\(\)"):
            trainer.step()
        return True
    assert run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **SGD),
                                             {"update_on_kvstore": True, **layout}), loop=loop) == [True] * W


def test_allreduce_grads_then_clip_then_update_is_the_same_as_ddp(make_cluster):
    """Gluon's split step, the form the refusal names: reduce, clip, update."""
    want = reference_clipped(lambda ps: torch.optim.SGD(ps, **SGD))

    def loop(model, trainer, rank, size):
        for x, y in batches():
            x, y = per_worker(x, y, rank, size)
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.allreduce_grads()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            trainer.update()
        return [p.detach().clone() for p in model.parameters()]
    for got in run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **SGD), {"bucket_bytes": 1}),
                        loop=loop):
        assert_same(got, want)


# -- accumulation: no_sync() --------------------------------------------------------------------

def accumulating_loop(use_no_sync):
    def loop(model, trainer, rank, size):
        for x, y in batches():
            x, y = per_worker(x, y, rank, size)
            half = len(y) // 2
            trainer.zero_grad()
            if use_no_sync:
                with trainer.no_sync():
                    (F.cross_entropy(model(x[:half]), y[:half]) / 2).backward()
            else:
                (F.cross_entropy(model(x[:half]), y[:half]) / 2).backward()
            (F.cross_entropy(model(x[half:]), y[half:]) / 2).backward()
            trainer.step()
        return [p.detach().clone() for p in model.parameters()]
    return loop


@pytest.mark.parametrize("update_on_kvstore", [pytest.param(False, id="workers-update"),
                                               pytest.param(True, id="servers-update")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_sync_accumulates_over_backward_passes_like_one_process(make_cluster, update_on_kvstore, layout):
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    handles = []

    def args(model):
        return torch.optim.SGD(model.parameters(), **SGD), {"update_on_kvstore": update_on_kvstore, **layout}

    def loop(model, trainer, rank, size):
        calls = trainer.kv.pushpull_async
        trainer.kv.pushpull_async = lambda *a, **k: handles.append(rank) or calls(*a, **k)
        return accumulating_loop(True)(model, trainer, rank, size)
    for got in run_dist(make_cluster, args, loop=loop):
        assert_same(got, want)
    # nothing was exchanged inside no_sync(): one exchange a step per bucket, as without accumulation
    sizes = [p.numel() * 4 for p in make_model().parameters()]
    one_step = 1 if layout.get("overlap") is False else len(sizes) if layout.get("bucket_bytes") == 1 \
        else buckets_of(sizes, kvtorch.bucket_bytes_for(sum(sizes), sizes[0]))     # 2: the model's halves
    if layout.get("flat_buckets"):
        one_step = 2
    assert len(handles) == W * len(list(batches())) * one_step


def test_a_second_backward_without_no_sync_averages_again_as_ddp(make_cluster):
    """DDP without no_sync() all-reduces at every backward: the second adds its own
    average to the first's. So does the Trainer with the workers updating."""
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    for got in run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **SGD), {}),
                        loop=accumulating_loop(False)):
        assert_same(got, want)


def test_a_second_backward_without_no_sync_is_refused_while_the_servers_update():
    with kvstore.create("local") as kv:
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  update_on_kvstore=True)
        x = torch.ones(2, 6)
        model(x).sum().backward()
        with pytest.raises(InvalidArgumentError, match=r"second gradient before step\(\).*no_sync\(\)"):
            model(x).sum().backward()
        trainer.close()


# -- torch.amp.GradScaler: scaler.unscale_(trainer), scaler.step(trainer) ---------------------

@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("target", ["trainer", "torch-optimizer"])
def test_a_grad_scaler_takes_the_trainer_or_its_optimizer_as_with_ddp(make_cluster, clip, target):
    """``scaler.scale(loss).backward(); [scaler.unscale_(t); clip]; scaler.step(t);
    scaler.update()`` with t the Trainer or the torch optimizer itself (DDP's form);
    rank 1's gradient overflows once: every worker skips that step alike."""
    want, want_scales = reference(clip=CLIP if clip else None)
    assert want_scales == [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE]     # grew, then halved

    def loop(model, trainer, rank, size):
        s, scales = scaler(), []
        t = trainer if target == "trainer" else trainer.torch_optimizer
        for step, (x, y) in enumerate(batches()):
            x, y = per_worker(x, y, rank, size)
            trainer.zero_grad()
            loss = s.scale(F.cross_entropy(model(x), y))
            if step == OVERFLOW_STEP and rank == 1:
                overflow_in_backward(model, loss)
            else:
                loss.backward()
            if clip:
                s.unscale_(t)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            s.step(t)
            s.update()
            scales.append(s.get_scale())
        return [p.detach().clone() for p in model.parameters()], scales
    for got, scales in run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                                         {"bucket_bytes": 1}), loop=loop):
        assert scales == want_scales
        assert_same(got, want)


def test_a_grad_scaler_used_on_a_trainer_whose_servers_update_names_the_trainers_option():
    """The servers unscale as backward ends: the scaler goes to the Trainer
    (tests/torch_integration/test_torch_amp_clip_job.py runs it), not to
    ``scaler.unscale_(trainer)`` / ``scaler.step(trainer)`` / ``step(scaler=)``."""
    with kvstore.create("local") as kv:
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  update_on_kvstore=True)
        s = scaler()
        s.scale(model(torch.ones(2, 6)).sum()).backward()
        for call in (lambda: s.unscale_(trainer), lambda: s.step(trainer), lambda: trainer.step(scaler=s)):
            with pytest.raises(InvalidArgumentError, match=r"Trainer\(\.\.\., grad_scaler=scaler\)"):
                call()
        trainer.close()


def test_ddps_scaler_and_clipping_with_the_servers_updating_refuse_what_they_cannot_honour(make_cluster):
    """DDP's loop with the servers updating (``Trainer(..., grad_scaler=scaler)``, one
    worker of dist_sync; tests/torch_integration/test_torch_amp_clip_job.py checks the
    bits): a scaler or clip_grad_norm_ before backward, clipping the still-scaled
    gradient, another norm than 2, clipping twice, and another scaler's unscale_ are
    refused, each naming the fix; the loop itself runs, returning torch's norm."""
    cluster = make_cluster(1, 1)

    def job(kv):
        model = make_model()
        s = scaler()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  update_on_kvstore=True, grad_scaler=s)
        x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0])
        loss = s.scale(F.cross_entropy(model(x), y))
        with pytest.raises(InvalidArgumentError, match=r"after scaler.scale\(loss\).backward\(\)"):
            s.unscale_(trainer)
        with pytest.raises(InvalidArgumentError, match=r"between backward\(\) and step\(\)"):
            trainer.clip_grad_norm_(1.0)
        plain = make_model()
        F.cross_entropy(plain(x), y).backward()
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)     # one worker: its gradient
        loss.backward()
        with pytest.raises(InvalidArgumentError, match=r"still scaled.*scaler.unscale_\(trainer\) first"):
            trainer.clip_grad_norm_(1.0)
        s.unscale_(trainer)
        with pytest.raises(InvalidArgumentError, match="norm_type=1.*2-norms"):
            trainer.clip_grad_norm_(1.0, norm_type=1)
        got = trainer.clip_grad_norm_(1e-3)
        with pytest.raises(InvalidArgumentError, match="twice in one step"):
            trainer.clip_grad_norm_(1e-3)
        s.step(trainer)
        s.update()
        stepped = [p.detach().clone() for p in model.parameters()]
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        other = torch.amp.GradScaler("cpu", init_scale=8.0)
        other.scale(F.cross_entropy(model(x), y)).backward()
        other.unscale_(trainer)
        with pytest.raises(InvalidArgumentError, match=r"grad_scaler's scale 4096\.0.*Trainer\(\.\.\., grad_scaler"):
            other.step(trainer)
        trainer.close()
        return got, want, stepped, [p.detach().clone() for p in plain.parameters()]
    [(got, want, stepped, plain)] = cluster.run(job, "dist_sync")
    assert got.dtype == torch.float32 and float(got) == float(want)
    assert_same(stepped, plain)       # clipped to 1e-3 by the servers, as torch clips


def test_clip_grad_norm_on_a_trainer_whose_servers_update_without_the_options_names_them():
    with kvstore.create("local") as kv:
        model = make_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  update_on_kvstore=True)
        model(torch.ones(2, 6)).sum().backward()
        with pytest.raises(InvalidArgumentError, match=r"grad_scaler=scaler.*clip_grad_norm=max_norm"):
            trainer.clip_grad_norm_(1.0)
        with pytest.raises(ArgumentTypeError, match="max_norm must be"):
            trainer.clip_grad_norm_(float("nan"))
        trainer.close()


def test_clipping_or_a_scaler_on_the_servers_of_a_store_without_their_two_phases_is_refused_up_front():
    """Only dist_sync's servers run the whole-model phases: a local store (or
    dist_async) refuses the Trainer's clip_grad_norm / grad_scaler with the servers
    updating when it is made, naming the workers-updating alternative."""
    model = make_model()
    for options in ({"clip_grad_norm": 1.0}, {"grad_scaler": scaler()}):
        with kvstore.create("local") as kv, \
                pytest.raises(InvalidArgumentError, match="update_on_kvstore=False.*to clip or scale here"):
            kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                            update_on_kvstore=True, **options)
    with kvstore.create("local") as kv:
        with pytest.raises(InvalidArgumentError, match="need a torch optimizer"):
            kvtorch.Trainer(model.parameters(), kv, kvstore.optimizer.SGD(learning_rate=0.1), clip_grad_norm=1.0)
        with pytest.raises(ArgumentTypeError, match="clip_grad_norm must be"):
            kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm="1")
        with pytest.raises(InvalidArgumentError, match="flat_buckets: clip_grad_norm_ computes a norm per parameter"):
            kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                            update_on_kvstore=True, clip_grad_norm=1.0, flat_buckets=True)


# -- small models: buckets sized by the model -------------------------------------------------------

def mid_model(seed=0):
    """1.06 MB of float32 parameters in 8 tensors: under the 4 MiB cap."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(),
                         nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 3))


def test_a_model_under_4_mib_is_exchanged_in_several_buckets_during_backward(make_cluster):
    model = mid_model()
    sizes = [p.numel() * 4 for p in model.parameters()]
    assert sum(sizes) < kvtorch.DEFAULT_BUCKET_BYTES
    when = []      # for each exchange: how many gradients had arrived when it started

    models = [mid_model(seed=r) for r in range(W)]    # made here: torch's RNG is shared by the job's threads

    def job(kv):
        model = models[kv.rank]
        opt = torch.optim.SGD(model.parameters(), **SGD)
        trainer = kvtorch.Trainer(model.parameters(), kv, opt)
        arrived = []
        for p in model.parameters():       # after the Trainer's hooks: counts the gradients
            p.register_post_accumulate_grad_hook(lambda p: arrived.append(1))
        calls = kv.pushpull_async
        kv.pushpull_async = lambda *a, **k: when.append(len(arrived)) or calls(*a, **k)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x, y = torch.randn(W * B, 32, generator=g), torch.randint(0, 3, (W * B,), generator=g)
            x, y = per_worker(x, y, kv.rank, kv.num_workers)
            arrived.clear()
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.step()
        return [p.detach().clone() for p in model.parameters()]

    results = make_cluster(W, 2).run(job)
    per_step = len(when) // (3 * W)
    assert per_step >= 3, when                 # several buckets a step
    assert min(when) < len(sizes) - 1          # the first started with gradients still to come
    # and it trains as one process does
    want = one_process(mid_model(), 3, 32, 3)
    for got in results:
        assert_same(got, want)


def one_process(model, steps: int, features: int, classes: int) -> list:
    """``model``'s parameters after ``steps`` SGD steps of one process on the W workers'
    batches together (the same generator the workers' batches come from)."""
    opt = torch.optim.SGD(model.parameters(), **SGD)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(W * B, features, generator=g), torch.randint(0, classes, (W * B,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def tiny_model(seed=0):
    """178 float32 parameters (712 bytes) in 4 tensors."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("update_on_kvstore", [False, True], ids=["workers-update", "servers-update"])
def test_a_tiny_model_has_a_request_in_flight_before_backward_ends(make_cluster, tmp_path, update_on_kvstore):
    """Overlap at any model size, seen in the timeline: in every step a pushpull
    request reached a server's link before the Trainer's ``backward ended`` (its
    end-of-backward callback, which sends whatever is left)."""
    models = [tiny_model(seed=r) for r in range(W)]
    sizes = [p.numel() * 4 for p in models[0].parameters()]
    steps = 3

    def job(kv):
        model = models[kv.rank]
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), **SGD),
                                  update_on_kvstore=update_on_kvstore)
        assert trainer.bucket_bytes < sum(sizes)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            x, y = torch.randn(W * B, 8, generator=g), torch.randint(0, 2, (W * B,), generator=g)
            x, y = per_worker(x, y, kv.rank, kv.num_workers)
            trainer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            trainer.step()
        return [p.detach().clone() for p in model.parameters()]

    results = make_cluster(W, 2, timeline=str(tmp_path)).run(job)
    for rank in range(W):
        events = json.loads((tmp_path / f"worker-{rank}.json").read_text())["traceEvents"]
        firsts = sorted(e["ts"] for e in events if e.get("cat") == "trainer" and e["name"] == "first gradient")
        ends = sorted(e["ts"] for e in events if e.get("cat") == "trainer" and e["name"] == "backward ended")
        sent = sorted(e["ts"] for e in events if e.get("cat") == "request" and e["name"] == "pushpull")
        assert len(firsts) == len(ends) == steps, (firsts, ends)
        for first, end in zip(firsts, ends):
            assert any(first <= t < end for t in sent), f"worker {rank}: no request between {first} and {end}"
    if not update_on_kvstore:      # and it trains as one process does
        want = one_process(tiny_model(), steps, 8, 2)
        for got in results:
            assert_same(got, want)


def test_a_bucket_fills_before_the_last_gradient_whatever_the_first_parameter_holds():
    assert kvtorch.bucket_bytes_for(1000, last_bytes=900) == 100    # the other 100 bytes: a bucket
    assert kvtorch.bucket_bytes_for(1000, last_bytes=10) == 500     # the halves
    assert kvtorch.bucket_bytes_for(1000, last_bytes=1000) == 500   # one parameter: nothing to cut
    with kvstore.create("local") as kv:
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))    # the first weight: 16 KiB of 16.8
        sizes = [p.numel() * 4 for p in model.parameters()]
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1))
        assert trainer.bucket_bytes == sum(sizes) - sizes[0]


def test_bucket_bytes_follow_the_model_between_the_floor_and_4_mib():
    with kvstore.create("local") as kv:
        model = mid_model()
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1))
        assert trainer.bucket_bytes == kvtorch.bucket_bytes_for(sum(p.numel() * 4 for p in model.parameters()))
    assert kvtorch.bucket_bytes_for(100 << 20) == kvtorch.DEFAULT_BUCKET_BYTES       # ResNet-50: 4 MiB
    assert kvtorch.bucket_bytes_for(1 << 20) == (1 << 20) // kvtorch.BUCKETS_PER_MODEL
    assert kvtorch.bucket_bytes_for(1000) == 500                                     # two buckets
    assert kvtorch.bucket_bytes_for(2 * kvtorch.MIN_BUCKET_BYTES) == kvtorch.MIN_BUCKET_BYTES
    with kvstore.create("local") as kv:
        model = make_model()
        assert kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                               bucket_bytes=1).bucket_bytes == 1                   # given: kept

"""The server-side pieces of a torch twin's whole-model step (``clip_grad_norm``,
``grad_scale``; kvstore.optimizer.torch_twin): phase 1 per chunk on a server's
updater (``norm_terms``), the leading worker's ``model_sums`` over every key, phase
2 (``apply_norms``), against what a worker runs under DDP on the averaged gradient
(``scaler.unscale_``: torch's ``_amp_foreach_non_finite_check_and_unscale_``;
``clip_grad_norm_``; ``torch.optim.AdamW.step``). The job over real servers:
tests/torch_integration/test_torch_amp_clip_job.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvstore.optimizer as kvopt  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402

W, SCALE, MAX_NORM = 2, 1024.0, 0.5
SHAPES = [(6, 5), (5,), (3, 6), (3,)]


def sums_of_two_workers(step: int, inf_at=None):
    """Per key the servers' sum of two workers' scaled gradients (float32)."""
    g = torch.Generator().manual_seed(step)
    out = [(torch.randn(s, generator=g) * SCALE + torch.randn(s, generator=g) * SCALE) for s in SHAPES]
    if inf_at is not None:
        out[inf_at][0] = float("inf")
    return out


def params():
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def torch_reference(steps):
    """A worker under DDP: average, unscale, clip, step (skipped on an overflow)."""
    ps = [torch.nn.Parameter(p.clone()) for p in params()]
    opt = torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    for sums in steps:
        scaler.scale(torch.zeros(()))      # (the scaler's first use makes its scale)
        for p, s in zip(ps, sums):
            p.grad = s.clone().div_(W)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ps, MAX_NORM)
        scaler.step(opt)
        scaler.update()
    return [p.detach() for p in ps], opt


def twin(**extra):
    return kvopt.create("torch_adamw", lr=0.01, weight_decay=0.1, rescale_grad=1.0 / W, clip_grad_norm=MAX_NORM,
                        grad_scale=SCALE, **extra)


def servers_run(steps, cut: int | None = None):
    """The two phases as the servers and the leading worker run them: each key whole
    (one chunk), or cut into chunks of ``cut`` elements (on several servers)."""
    updater = kvopt.Updater(twin())
    weights = [p.numpy().reshape(-1).copy() for p in params()]
    scale = SCALE
    for sums in steps:
        if updater.optimizer.grad_scale != scale:      # the scaler backed off: the Trainer sends it
            updater.replace_optimizer(kvopt.from_config(
                {**updater.optimizer.to_config(), "params": {**updater.optimizer.to_config()["params"],
                                                            "grad_scale": scale}}))
        chunks = []      # per key: its chunks (weight, weight view, grad view)
        for key, (w, s) in enumerate(zip(weights, sums)):
            flat = s.numpy().reshape(-1)
            bounds = [(0, w.size)] if cut is None else [(a, min(a + cut, w.size)) for a in range(0, w.size, cut)]
            chunks.append([((key, i), w[a:b], flat[a:b].copy()) for i, (a, b) in enumerate(bounds)])
        phase1 = [[updater.norm_terms(index, g, w) for index, w, g in key] for key in chunks]
        sums_every_chunk = updater.optimizer.model_sums([[terms for terms, _ in key] for key in phase1])
        for key, done in zip(chunks, phase1):
            for (index, w, g), (_, carry) in zip(key, done):
                updater.apply_norms(index, g, w, sums_every_chunk, carry)
        if sums_every_chunk[1]:
            scale /= 2
    return [torch.from_numpy(w).reshape(s) for w, s in zip(weights, SHAPES)], updater


def test_the_two_phases_on_whole_keys_are_ddps_unscale_clip_and_step_bit_for_bit():
    steps = [sums_of_two_workers(i) for i in range(4)]
    want, _ = torch_reference(steps)
    got, _ = servers_run(steps)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_an_overflow_in_any_chunk_skips_the_step_everywhere_its_count_too():
    """The inf at step 1 in key 2: no key moves, no key's Adam count advances (torch's
    step count stays), so the later steps' bias corrections are torch's."""
    steps = [sums_of_two_workers(0), sums_of_two_workers(1, inf_at=2), sums_of_two_workers(2)]
    want, opt = torch_reference(steps)
    got, updater = servers_run(steps)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert int(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 2
    counts = {index: entry["t"] for index, entry in updater.get_states().items()}
    assert counts and set(counts.values()) == {2}        # 3 rounds, 1 skipped: torch's step count
    terms = [[[1.0, 0.0]], [[2.0, 1.0]]]
    assert twin().model_sums(terms) == [1.0, 1.0]          # skipped: any chunk's overflow
    assert twin().skips([1.0, 1.0]) and not twin().skips([0.3, 0.0])


def test_keys_cut_into_chunks_get_their_norm_from_the_chunks_norms_within_a_measured_tolerance():
    """A key cut over servers: its norm is the root of its chunks' squared norms (not
    torch's one reduction), so equality is not guaranteed; the weights differ from
    DDP's by at most TOL, and a clip coefficient 10% off would exceed it."""
    steps = [sums_of_two_workers(i) for i in range(4)]
    want, _ = torch_reference(steps)
    got, _ = servers_run(steps, cut=4)
    diff = max(float((a - b).abs().max()) for a, b in zip(want, got))
    tol = 1e-6
    assert diff <= tol
    # the tolerance catches a 10% error in the clip coefficient: one step with it
    ps = [p.clone() for p in params()]
    g = [s / W / SCALE for s in steps[0]]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))
    coef = float(torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0))
    one = [p - 0.01 * x * coef for p, x in zip(ps, g)]
    off = [p - 0.01 * x * coef * 1.1 for p, x in zip(ps, g)]
    assert max(float((a - b).abs().max()) for a, b in zip(one, off)) > 100 * tol


def test_the_twins_whole_model_options_round_trip_and_are_checked():
    t = twin()
    assert t.whole_model and t.splits_norms and not kvopt.create("torch_adamw").whole_model
    back = kvopt.from_config(t.to_config())
    assert (back.clip_grad_norm, back.grad_scale, back.whole_model) == (MAX_NORM, SCALE, True)
    assert t.with_groups(t.groups).grad_scale == SCALE
    for bad in ({"grad_scale": 0.0}, {"grad_scale": float("inf")}, {"clip_grad_norm": -1.0}):
        with pytest.raises(ConfigError):
            kvopt.create("torch_sgd", **bad)
    # a store that updates key by key (no two phases) cannot run it: loud, naming why
    with pytest.raises(ConfigError, match="whole model"):
        t.update(np.zeros(3, np.float32), np.ones(3, np.float32), t.create_state(np.zeros(3, np.float32)), 1)
    with pytest.raises(ValueError, match="not finite"):
        kvopt.create("torch_sgd", clip_grad_norm=1.0).model_sums([[[float("inf"), 0.0]]])


def test_the_public_ops_the_twin_runs_give_the_bits_of_torchs_private_ones():
    """Phase 1 unscales with ``mul_`` and takes ``vector_norm``; GradScaler and
    clip_grad_norm_'s foreach path run ``_amp_foreach_non_finite_check_and_unscale_``
    and ``_foreach_norm``: the same bits on these sizes."""
    inv = torch.tensor(SCALE, dtype=torch.float64).reciprocal().float()
    for n in (1, 7, 64, 1000, 70000):
        g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * SCALE
        x, found = g.clone(), torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv)
        assert torch.equal(x, g.clone().mul_(inv)) and found.item() == 0
        assert torch.equal(torch._foreach_norm([x], 2.0)[0], torch.linalg.vector_norm(x, 2.0))

"""A real 2-worker, 2-server job (``python -m tracker.local -n 2 -s 2``,
tests/scripts/twin_job.py) trains a small model with SGD + OneCycleLR (cycling the
momentum) and with AdamW over two param groups, once with the workers updating
(torch's optimizer on the averaged gradients, as DDP) and once with the servers
updating (torch's twin there, keys cut into 64-element chunks over both servers):
the weights, every optimizer state and the param groups are the same bits, and the
servers' ``state_dict()`` loads back (``load_state_dict``) to the same bits."""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from services import import_script, run_local_job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "twin_job.py")
DEADLINE = 120      # seconds for the job (4 processes importing torch on 2 cores, 4 short runs)
RECIPES = ["sgd", "adamw"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("twins")
    out = folder / "result.pt"
    run_local_job(SCRIPT, str(out), cwd=folder, env={"KVSTORE_CHUNK_BYTES": "256"}, timeout=DEADLINE)
    return torch.load(out, weights_only=True)


def _equal_states(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for i, one in a["state"].items():
        assert one.keys() == b["state"][i].keys(), i
        for name, value in one.items():
            assert torch.equal(value, b["state"][i][name]), (i, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_servers_updating_give_the_weights_of_workers_updating_bit_for_bit(job, recipe):
    workers, servers = job[f"{recipe}-workers"], job[f"{recipe}-servers"]
    for a, b in zip(workers["weights"], servers["weights"]):
        assert torch.equal(a, b)
    # the schedule moved what the servers had to follow: OneCycleLR's momentum, the cosine's rates
    groups = servers["state"]["param_groups"]
    if recipe == "sgd":
        assert groups[0]["momentum"] != 0.9 and groups[0]["momentum"] == pytest.approx(0.9423, abs=1e-4)
    else:
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0] and groups[1]["lr"] < 3e-3


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_servers_state_dict_is_torchs_and_loads_back(job, recipe):
    workers, servers = job[f"{recipe}-workers"], job[f"{recipe}-servers"]
    _equal_states(workers["state"], servers["state"])       # the same bits in torch's format
    _equal_states(servers["state"], servers["reloaded"])    # load_state_dict, then state_dict again
    names = {"sgd": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}}[recipe]
    assert all(set(one) == names for one in servers["state"]["state"].values())


def _one_process(recipe: str, cycle_momentum: bool = True, lr_scale: float = 1.0) -> list:
    """The job's recipe in one process on the whole batches (tests/scripts/twin_job.py)."""
    r = import_script("twin_job_recipes")
    m = r.model()
    opt, sched = r.RECIPES[recipe](m, cycle_momentum=cycle_momentum, lr_scale=lr_scale)
    g = torch.Generator().manual_seed(1)
    for _ in range(r.STEPS):
        x, y = torch.randn(r.BATCH, 10, generator=g), torch.randint(0, 4, (r.BATCH,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_both_modes_follow_one_process_on_the_whole_batch(job, recipe):
    """Against one process on the whole batch of 16 the job differs by rounding only:
    its gradient is the average of two half-batch means, summed in another order
    (measured: at most 6e-8 after 8 steps); the tolerance would see the schedule's
    momentum dropped, or every rate 10% off."""
    want = _one_process(recipe)
    diff = max(float((a - b).abs().max()) for a, b in zip(job[f"{recipe}-servers"]["weights"], want))
    assert diff <= 1e-6, diff
    wrong = [_one_process(recipe, lr_scale=1.1)] + ([_one_process(recipe, cycle_momentum=False)]
                                                    if recipe == "sgd" else [])
    for other in wrong:
        assert max(float((a - b).abs().max()) for a, b in zip(other, want)) > 1e-4

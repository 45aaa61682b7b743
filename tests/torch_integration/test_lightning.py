"""kvstore.lightning.KVStoreStrategy with a real lightning.Trainer: 2 workers under
tracker.local and under torchrun end with the weights of Lightning's own DDP
strategy (gloo, CPU, under torchrun) after the same steps, in both update modes,
and Lightning's collectives (broadcast, reduce, all_gather, barrier, the data
sampler's shard, the metrics logged with sync_dist and torchmetrics' states) go
through the store: the scheduler's authenticated channel, with no socket of the
strategy's own (it had a torch TCPStore listening on every interface, without
authentication, while the servers update). In one process, the 'local' store
trains as Lightning's single-device strategy does."""

import ast

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("lightning") is None:
    pytest.skip("could not import 'lightning': it is not installed", allow_module_level=True)

import kvstore  # noqa: E402
from services import eventually_empty, tagged  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from listening import on_every_interface  # noqa: E402   (tests/scripts/listening.py)

# Lightning takes seconds to import: the module's tests import it (below), not its
# collection, which every pytest-xdist worker does for every module
L = KVStoreStrategy = None


@pytest.fixture(autouse=True, scope="module")
def lightning_imported():
    global L, KVStoreStrategy
    L = pytest.importorskip("lightning")
    from kvstore.lightning import KVStoreStrategy as strategy    # an error here fails the tests
    KVStoreStrategy = strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "lightning_job.py")
TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
DEADLINE = 100     # seconds for one job (2 workers importing Lightning on 2 cores)
MODES = [pytest.param(False, id="workers-update"), pytest.param(True, id="servers-update")]


def env_for(tag):
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    drop = {k for k in os.environ if k.startswith(("KVSTORE_", "DMLC_"))}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": path,
            "KVSTORE_TEST_TAG": tag, "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
            "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}


def run_job(launcher, tmp_path, *args):
    """Run tests/scripts/lightning_job.py with 2 workers; rank 0's results and the output."""
    out, tag = tmp_path / f"result-{uuid.uuid4().hex}.pt", uuid.uuid4().hex
    script = [SCRIPT, str(out), *args]
    if launcher == "torchrun":
        argv = [TORCHRUN, "--standalone", "--nproc-per-node", "2", *script]
    else:
        argv = [sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", sys.executable, *script]
    p = subprocess.run(argv, check=False, env=env_for(tag), cwd=tmp_path, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=DEADLINE)
    assert p.returncode == 0, p.stdout
    assert not eventually_empty(lambda: tagged(tag)), "processes of the job outlived it"
    return torch.load(out, weights_only=True), p.stdout


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Lightning's DDP strategy (gloo, CPU) with 2 processes under torchrun: the reference."""
    if not os.path.exists(TORCHRUN):
        pytest.skip("torchrun is not installed")
    result, _ = run_job("torchrun", tmp_path_factory.mktemp("ddp"), "--strategy", "ddp")
    return result


def assert_like_ddp(got, want, steps=8):
    assert got["steps"] == want["steps"] == steps
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-7)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)     # logged with sync_dist=True
    # torchmetrics computed over both workers: 2 epochs x 32 samples; 8 steps x (1 + 2) labels
    assert got["seen"] == want["seen"] == 64.0 and got["labels"] == want["labels"] == 24


def assert_collectives(text):
    for rank in (0, 1):
        line = re.search(rf"rank {rank} of 2: (broadcast .*? sampler 2:\d)", text)   # lines may interleave
        assert line, text
        assert line.group(1) == (f"broadcast {{'from': 0, 'p': [0]}} max [2.0, 0.0] gather [0, 1] "
                                 f"stop True/False sampler 2:{rank}"), text


def assert_listens_on_nothing_of_its_own(text, launcher):
    """No worker listens on every interface; under tracker.local a worker listens on
    nothing at all, under torchrun rank 0 only on its scheduler's loopback port."""
    for rank in (0, 1):
        line = re.search(rf"rank {rank} listens on (\[.*\])$", text, re.MULTILINE)
        assert line, text
        addresses = ast.literal_eval(line.group(1))
        assert not on_every_interface(addresses), f"worker {rank} listens on every interface: {addresses}"
        hosts_scheduler = launcher == "torchrun" and rank == 0
        assert len(addresses) == hosts_scheduler and all(a.startswith("127.") for a in addresses), addresses


@pytest.mark.slow
@pytest.mark.parametrize("launcher, update_on_kvstore", [
    # each launcher and each mode once: how the processes start and meet (torchrun's
    # store, rank 0 hosting the scheduler) does not depend on who updates
    pytest.param("tracker.local", False, id="tracker.local-workers-update"),
    pytest.param("torchrun", True, id="torchrun-servers-update")])
def test_two_workers_end_with_the_weights_of_lightning_ddp(ddp, tmp_path, launcher, update_on_kvstore):
    got, text = run_job(launcher, tmp_path, "--strategy", "kvstore",
                        *(["--update-on-kvstore"] if update_on_kvstore else []))
    assert_like_ddp(got, ddp)       # the metrics too: the loss logged with sync_dist, torchmetrics
    assert_collectives(text)
    assert_listens_on_nothing_of_its_own(text, launcher)


@pytest.mark.slow
@pytest.mark.parametrize("how, update_on_kvstore", [("--by-name", False), ("--by-name", True), ("--cli", False)])
def test_the_registered_name_and_lightning_cli_train_as_lightning_ddp(ddp, tmp_path, how, update_on_kvstore):
    """``L.Trainer(strategy="kvstore")`` (or ``"kvstore_update_on_kvstore"``) and
    LightningCLI's ``--trainer.strategy=kvstore``, as Lightning names DDP: "ddp"."""
    if how == "--cli":
        pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")
    got, text = run_job("tracker.local", tmp_path, "--strategy", "kvstore", how,
                        *(["--update-on-kvstore"] if update_on_kvstore else []))
    assert_like_ddp(got, ddp)
    assert_collectives(text)


AMP_CLIP = ["--amp", "--clip", "0.5", "--inf-step", "2"]


@pytest.fixture(scope="module")
def ddp_amp_clip(tmp_path_factory):
    """Lightning's DDP (gloo) with float16 autocast, Lightning's GradScaler, gradient_clip_val
    and an inf on worker 1 at step 2: the reference for both update modes."""
    if not os.path.exists(TORCHRUN):
        pytest.skip("torchrun is not installed")
    result, _ = run_job("torchrun", tmp_path_factory.mktemp("ddp-amp-clip"), "--strategy", "ddp", *AMP_CLIP)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("update_on_kvstore", MODES)
def test_a_grad_scaler_and_gradient_clipping_train_as_lightning_ddp(ddp_amp_clip, tmp_path, update_on_kvstore):
    """``strategy="kvstore_update_on_kvstore"`` with Lightning's GradScaler (float16
    autocast: ``plugins=[MixedPrecision("16-mixed", "cpu", scaler)]``, as Lightning
    turns ``precision="16-mixed"`` into bf16 on a CPU) and ``gradient_clip_val``: the
    servers unscale, clip by the whole model's norm, skip worker 1's overflow on every
    worker, and the scale backs off and grows as under DDP; the weights are DDP's. The
    workers updating (``strategy="kvstore"``) too, where Lightning itself unscales and clips."""
    want = ddp_amp_clip
    assert max(want["norms"]) > 0.5, want["norms"]    # the clipping mattered at some step
    assert want["scales"][2] == want["scales"][1] / 2 and want["scales"][-1] > want["scales"][2], want["scales"]
    got, _ = run_job("tracker.local", tmp_path, "--strategy", "kvstore", "--by-name", *AMP_CLIP,
                     *(["--update-on-kvstore"] if update_on_kvstore else []))
    assert got["scales"] == want["scales"]
    assert_like_ddp(got, want)
    assert all(torch.equal(w, got["weights"][n]) for n, w in want["weights"].items())    # bit for bit


@pytest.mark.slow
def test_accumulated_batches_with_a_grad_scaler_and_clipping_on_the_servers_train_as_lightning_ddp(tmp_path):
    """accumulate_grad_batches=2 (Lightning's block_backward_sync: the Trainer's
    no_sync()) with the GradScaler, clipping and an inf on worker 1 at step 1, the
    servers updating: DDP's weights bit for bit and its scales."""
    if not os.path.exists(TORCHRUN):
        pytest.skip("torchrun is not installed")
    settings = ["--amp", "--clip", "0.5", "--inf-step", "1", "--accumulate", "2"]
    want, _ = run_job("torchrun", tmp_path, "--strategy", "ddp", *settings)
    assert max(want["norms"]) > 0.5 and want["scales"][3] == want["scales"][2] / 2, want    # clipped; skipped
    got, _ = run_job("tracker.local", tmp_path, "--strategy", "kvstore", "--by-name", "--update-on-kvstore",
                     *settings)
    assert got["scales"] == want["scales"]
    assert_like_ddp(got, want, steps=4)
    assert all(torch.equal(w, got["weights"][n]) for n, w in want["weights"].items())    # bit for bit


@pytest.mark.slow
def test_gradient_clipping_on_the_servers_with_lightnings_cpu_16_mixed_trains_as_lightning_ddp(tmp_path):
    """``precision="16-mixed"`` on a CPU is Lightning's bfloat16 autocast without a
    scaler; with ``gradient_clip_val`` and the servers updating (the servers clip by
    the whole model's norm) the weights are those of Lightning's DDP with the same settings."""
    if not os.path.exists(TORCHRUN):
        pytest.skip("torchrun is not installed")
    settings = ["--precision", "16-mixed", "--clip", "0.5"]
    want, _ = run_job("torchrun", tmp_path, "--strategy", "ddp", *settings)
    assert max(want["norms"]) > 0.5 and want["scales"] == [], want     # clipped; no scaler: bf16
    got, _ = run_job("tracker.local", tmp_path, "--strategy", "kvstore", "--by-name", "--update-on-kvstore",
                     *settings)
    assert_like_ddp(got, want)
    assert all(torch.equal(w, got["weights"][n]) for n, w in want["weights"].items())    # bit for bit


# -- one process: the 'local' store --------------------------------------------------------
def lightning_fit(strategy, *, accumulate=1, optimizer="sgd", steps=6, clip=None, clip_algorithm=None,
                  own_clipping=False, manual=False, scaler=False):
    """A real lightning.Trainer, a tiny regression and its data (before fit).
    ``own_clipping``: the module overrides configure_gradient_clipping; ``manual``:
    manual optimization; ``scaler``: float16 autocast and Lightning's GradScaler."""
    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.lin(x), y)
            if manual and optimizer != "two":
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        if own_clipping:
            def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
                self.clip_gradients(optimizer, 0.1, "norm")

        def configure_optimizers(self):
            if optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=0.01)
            if optimizer == "nadam":        # no twin on the servers
                return torch.optim.NAdam(self.parameters(), lr=0.01)
            if optimizer == "two":
                return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))
    torch.manual_seed(0)
    model = Net()
    if optimizer == "two" or manual:
        model.automatic_optimization = False
    plugins = []
    if scaler:
        from lightning.pytorch.plugins import MixedPrecision   # on a CPU "16-mixed" alone is bf16, no scaler
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, plugins=plugins,
                        gradient_clip_algorithm=clip_algorithm,
                        accumulate_grad_batches=accumulate, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)   # Lightning's shuffles training data
    return trainer, model, torch.utils.data.DataLoader(data, batch_size=4)


def fit(strategy, **kwargs):
    """The final weights of :func:`lightning_fit`'s model."""
    trainer, model, loader = lightning_fit(strategy, **kwargs)
    trainer.fit(model, train_dataloaders=loader)
    return [p.detach().clone() for p in model.parameters()]


def test_a_checkpoint_carries_the_servers_optimizer_state_and_resumes_from_it(tmp_path):
    """With the servers updating, Lightning's checkpoint holds the servers' Adam state
    in torch's format (Trainer.state_dict): the bits of Lightning's own single-device
    run; resuming from it (the state sent back to the servers) ends with the weights
    of that run resumed the same way, bit for bit."""
    def run(strategy, steps, ckpt=None, save=None):
        trainer, model, loader = lightning_fit(strategy, optimizer="adam", steps=steps)
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        return [p.detach().clone() for p in model.parameters()]

    for name, strategy in (("auto", lambda: "auto"),
                           ("servers", lambda: KVStoreStrategy("local", update_on_kvstore=True))):
        run(strategy(), 3, save=tmp_path / f"{name}.ckpt")
    want = torch.load(tmp_path / "auto.ckpt", weights_only=False)["optimizer_states"][0]
    got = torch.load(tmp_path / "servers.ckpt", weights_only=False)["optimizer_states"][0]
    assert got["state"].keys() == want["state"].keys() and len(want["state"]) == 2
    for i, one in want["state"].items():
        assert sorted(one) == sorted(got["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(v, got["state"][i][n]) for n, v in one.items())
    resumed = run(KVStoreStrategy("local", update_on_kvstore=True), 6, ckpt=tmp_path / "servers.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(resumed, run("auto", 6, ckpt=tmp_path / "auto.ckpt")))
    # the state mattered: resumed without it (a fresh Adam) the weights differ
    fresh = torch.load(tmp_path / "servers.ckpt", weights_only=False)
    fresh["optimizer_states"][0]["state"] = {}
    torch.save(fresh, tmp_path / "fresh.ckpt")
    assert not all(torch.equal(a, b) for a, b in zip(
        resumed, run(KVStoreStrategy("local", update_on_kvstore=True), 6, ckpt=tmp_path / "fresh.ckpt")))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("update_on_kvstore", MODES)
def test_the_local_store_trains_like_a_single_device(update_on_kvstore, accumulate):
    """Accumulating, the backward passes before an optimizer step run in the
    Trainer's no_sync() (Lightning's block_backward_sync, as with DDP): nothing is
    exchanged there, and the last one's exchange still starts from its hooks, during
    backward (one bucket per parameter here: the first before the second gradient)."""
    want = fit("auto", accumulate=accumulate)
    strategy = KVStoreStrategy("local", update_on_kvstore=update_on_kvstore, bucket_bytes=1)
    arrived, when = [], []
    calls = strategy.kv.pushpull_async
    strategy.kv.pushpull_async = lambda *a, **k: when.append(len(arrived)) or calls(*a, **k)
    trainer, model, loader = lightning_fit(strategy, accumulate=accumulate)
    for p in model.parameters():       # counts the gradients of each backward
        p.register_post_accumulate_grad_hook(lambda p: arrived.append(1))
    trainer.fit(model, train_dataloaders=loader)
    got = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    steps, params = 6, len(got)
    assert len(when) == steps * params          # one exchange per parameter per optimizer step
    for s, first in enumerate(when[::params]):
        # during the step's last backward: after the gradients of the ones before, before its last
        assert (s * accumulate + accumulate - 1) * params <= first < (s + 1) * accumulate * params, when
    assert (strategy.world_size, strategy.global_rank, strategy.distributed_sampler_kwargs) == \
        (1, 0, {"num_replicas": 1, "rank": 0})
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert strategy.reduce(torch.tensor(2.0)).item() == 2.0


def test_a_store_given_by_the_user_is_used_and_left_open():
    kv = kvstore.create("local")
    strategy = KVStoreStrategy(kv)
    fit(strategy, steps=2)
    assert strategy.kv is kv
    strategy.close()
    kv.pull("lin.weight", out=torch.empty(2, 4))   # still open: the user closes it


def test_a_second_fit_on_the_same_strategy_is_a_clear_error():
    trainer, model, loader = lightning_fit(KVStoreStrategy("local"), steps=1)
    trainer.fit(model, train_dataloaders=loader)
    trainer.fit_loop.epoch_loop.max_steps = 2
    with pytest.raises(kvstore.KVStoreError, match="one fit"):
        trainer.fit(model, train_dataloaders=loader)


def test_gradient_clipping_applies_to_the_averaged_gradients():
    want = fit("auto", clip=0.05)
    got = fit(KVStoreStrategy("local"), clip=0.05)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs, update_on_kvstore, match", [
    ({"optimizer": "nadam"}, True, "twins of torch.optim.SGD, .* not torch.optim.nadam.NAdam"),
    # (the local store has one server and no two phases: dist_sync clips and unscales)
    ({"clip": 1.0}, True, r"gradient_clip_val=1.0 as clip_grad_norm: .*does not add up norms"),
    ({"scaler": True}, True, r"precision plugin's GradScaler as grad_scaler: .*does not add up norms"),
    ({"clip": 1.0, "clip_algorithm": "value"}, True, "gradient_clip_algorithm='value'"),
    ({"own_clipping": True}, True, "Net.configure_gradient_clipping is overridden"),
    ({"manual": True, "scaler": True}, True, r"manual optimization \(automatic_optimization=False\)"),
    ({"optimizer": "two"}, False, "one optimizer per step"),
])
def test_what_the_strategy_cannot_do_is_a_clear_error(kwargs, update_on_kvstore, match):
    with pytest.raises(kvstore.KVStoreError, match=match):
        fit(KVStoreStrategy("local", update_on_kvstore=update_on_kvstore), **kwargs)


def test_bad_arguments_are_named():
    with pytest.raises(kvstore.ArgumentTypeError, match="store type"):
        KVStoreStrategy(3)
    with pytest.raises(kvstore.ArgumentTypeError, match="update_on_kvstore"):
        KVStoreStrategy("local", update_on_kvstore="yes")


def test_without_lightning_the_import_error_names_the_extra():
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
            "import kvstore.lightning")
    p = subprocess.run([sys.executable, "-c", code], check=False, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "pip install 'kvstore[lightning]'" in p.stderr, p.stderr

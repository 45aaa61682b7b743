"""kvstore.torch.Trainer(flat_buckets=True): the parameters that train as views of
flat buffers, one key per bucket (kvstore/flat_buckets.py). It trains exactly as
one key per parameter does, in both update modes, with and without overlap."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import kvstore  # noqa: E402
import kvstore.torch as kvtorch  # noqa: E402
from kvstore import optimizer as kvopt  # noqa: E402
from kvstore.errors import InvalidArgumentError  # noqa: E402
from kvstore.flat_buckets import FlatBuckets  # noqa: E402

from test_torch_trainer import SGD, W, assert_same, batches, make_model, reference_torch, run_dist, train  # noqa: E402


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_flat_buckets_train_exactly_as_one_key_per_parameter(make_cluster, update_on_kvstore, overlap):
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))
    buckets = []

    def args(model):
        return torch.optim.SGD(model.parameters(), **SGD), {
            "update_on_kvstore": update_on_kvstore, "overlap": overlap, "flat_buckets": True, "bucket_bytes": 100}

    def loop(model, trainer, rank, size):
        buckets.append([b.indices for b in trainer._flat.buckets])
        return train(model, trainer, rank, size)
    for got in run_dist(make_cluster, args, loop=loop):
        assert_same(got, want)
    assert buckets == [[[3, 2], [1, 0]]] * W     # 12 + 96 bytes, cut at >= 100; then 32 + 192


def test_a_model_of_many_small_parameters_is_a_few_keys():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])       # 20 parameters
    with kvstore.create("local") as kv:
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  flat_buckets=True, bucket_bytes=200)
        buckets = trainer._flat.buckets
        assert [len(b.indices) for b in buckets] == [6, 6, 6, 2]     # 16 + 64 bytes a layer, cut at >= 200
        assert buckets[0].indices == [19, 18, 17, 16, 15, 14]        # reverse order: as backward makes them
        for b in buckets:
            for i in b.indices:
                p = list(model.parameters())[i]
                assert p.data_ptr() == b.weight[b.offsets[i]:].data_ptr()      # the data is a view
                assert p.grad.data_ptr() == b.grad[b.offsets[i]:].data_ptr()   # and so is .grad
        handles = []
        start = kv.pushpull_async
        kv.pushpull_async = lambda *a, **k: handles.append(a[0]) or start(*a, **k)
        trainer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        trainer.step()
        assert sorted(handles) == [b.key for b in buckets] == [20, 21, 22, 23]   # one pushpull each


def test_gradients_replaced_by_model_zero_grad_are_copied_into_the_buckets(make_cluster):
    """A loop that clears gradients with the model's zero_grad (set to None) gets new
    .grad tensors from backward: each is copied into its bucket, same training."""
    want = reference_torch(lambda ps: torch.optim.SGD(ps, **SGD))

    def loop(model, trainer, rank, size):
        per = W * 4 // size
        for x, y in batches():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
            trainer.step()
        return [p.detach().clone() for p in model.parameters()]
    results = run_dist(make_cluster, lambda m: (torch.optim.SGD(m.parameters(), **SGD),
                                                {"update_on_kvstore": False, "flat_buckets": True}), loop=loop)
    for got in results:
        assert_same(got, want)


def test_an_unused_parameter_is_exchanged_as_zeros_as_without_buckets():
    def run(flat):
        torch.manual_seed(0)
        model = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        with kvstore.create("local") as kv:
            trainer = kvtorch.Trainer(model.parameters(), kv, opt, update_on_kvstore=True, flat_buckets=flat)
            for _ in range(3):
                trainer.zero_grad()
                model["used"](torch.ones(2, 3)).sum().backward()
                trainer.step()
        return [p.detach().clone() for p in model.parameters()]
    assert_same(run(True), run(False))


def test_flat_buckets_refuse_layerwise_optimizers_and_later_freezing():
    model = make_model()
    with kvstore.create("local") as kv:
        with pytest.raises(InvalidArgumentError, match="LARS computes a norm per key"):
            kvtorch.Trainer(model.parameters(), kv, kvopt.LARS(learning_rate=0.1), flat_buckets=True)
    model = make_model()
    with kvstore.create("local") as kv:
        trainer = kvtorch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=0.1),
                                  flat_buckets=True)
        model[0].weight.requires_grad_(False)
        trainer.zero_grad()
        with pytest.raises(InvalidArgumentError, match="frozen after the Trainer was made"):
            model(torch.ones(2, 6)).sum().backward()    # the exchange finishes as backward ends


def test_a_sparse_gradient_is_added_densely_into_its_bucket_or_refused_by_name():
    """Autograd adds a sparse gradient into an existing dense .grad (the bucket's view)
    densely; a sparse .grad of its own (the view cleared first) is refused."""
    emb = nn.Embedding(10, 3, sparse=True)
    with kvstore.create("local") as kv:
        trainer = kvtorch.Trainer(emb.parameters(), kv, torch.optim.SGD(emb.parameters(), lr=0.1),
                                  flat_buckets=True)
        before = emb.weight.detach().clone()
        trainer.zero_grad()
        emb(torch.tensor([1, 2])).sum().backward()
        trainer.step()
        changed = (emb.weight.detach() != before).any(dim=1)
        assert changed.tolist() == [False, True, True] + [False] * 7
        emb.zero_grad(set_to_none=True)
        with pytest.raises(InvalidArgumentError, match="parameter 0 got a sparse gradient"):
            emb(torch.tensor([1, 2])).sum().backward()


def test_buckets_group_by_dtype_and_keep_each_parameters_values():
    params = [torch.ones(3), torch.full((2,), 2.0, dtype=torch.float64), torch.full((4,), 3.0)]
    buckets = FlatBuckets(params, [2, 1, 0], bucket_bytes=1 << 20, key_of=lambda b: f"bucket.{b}")
    assert [(b.key, b.indices, b.weight.dtype) for b in buckets.buckets] == \
        [("bucket.0", [2, 0], torch.float32), ("bucket.1", [1], torch.float64)]
    assert [p.tolist() for p in params] == [[1.0] * 3, [2.0] * 2, [3.0] * 4]
    assert buckets.buckets[0].weight.tolist() == [3.0] * 4 + [1.0] * 3

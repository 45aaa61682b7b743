"""ShardedEmbedding trains exactly like torch's own sparse embedding + SGD, on the
local store and on dist_sync (its table on the servers)."""

import pytest
import torch

import kvstore
from kvstore import optimizer as opt
from kvstore.torch import ShardedEmbedding

pytestmark = pytest.mark.timeout(120)

ROWS, DIM, LR = 40, 5, 0.5


def batches(steps, rank=0):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randint(0, ROWS, (6, 3), generator=g), torch.randn(6, DIM, generator=g)) for _ in range(steps)]


def reference(mode, steps, start, workers=1):
    """torch: nn.Embedding(Bag)(sparse=True) from the same table, plain SGD on the summed gradients."""
    if mode is None:
        emb = torch.nn.Embedding(ROWS, DIM, sparse=True, _weight=start.clone())
    else:
        emb = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=True, _weight=start.clone())
    sgd = torch.optim.SGD(emb.parameters(), lr=LR)
    per_worker = [batches(steps, r) for r in range(workers)]
    for step in range(steps):
        sgd.zero_grad()
        for r in range(workers):
            ids, target = per_worker[r][step]
            out = emb(ids) if mode is None else emb(ids)
            loss = ((out.sum(1) if mode is None else out) - target).pow(2).sum()
            loss.backward()
        sgd.step()
    return emb.weight.detach()


def train(kv, mode, steps):
    emb = ShardedEmbedding(ROWS, DIM, kv, key="emb", init=("uniform", 0.5), mode=mode, seed=4)
    start = torch.zeros(ROWS, DIM)
    kv.row_sparse_pull("emb", out=start, row_ids=torch.arange(ROWS))
    kv.set_optimizer(opt.SGD(learning_rate=LR))
    for ids, target in batches(steps, kv.rank):
        out = emb(ids)
        ((out.sum(1) if mode is None else out) - target).pow(2).sum().backward()
        emb.step()
    final = torch.zeros(ROWS, DIM)
    kv.row_sparse_pull("emb", out=final, row_ids=torch.arange(ROWS))
    return start, final


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
def test_local_matches_torch_sparse_embedding_and_sgd(mode):
    start, final = train(kvstore.create("local"), mode, 4)
    torch.testing.assert_close(final, reference(mode, 4, start), rtol=1e-5, atol=1e-6)


def test_dist_sync_sums_the_workers_rows_like_one_process(make_cluster):
    results = make_cluster(2, 2).run(lambda kv: train(kv, "sum", 3))
    start, final = results[0]
    torch.testing.assert_close(final, reference("sum", 3, start, workers=2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], final)


def test_eval_mode_pushes_nothing_and_a_forward_without_backward_adds_nothing():
    kv = kvstore.create("local")
    emb = ShardedEmbedding(ROWS, DIM, kv, key="e", init=("normal", 0.1))
    kv.set_optimizer(opt.SGD(learning_rate=LR))
    before = torch.zeros(ROWS, DIM)
    kv.row_sparse_pull("e", out=before, row_ids=torch.arange(ROWS))
    emb.eval()
    emb(torch.tensor([1, 2]))
    emb.train()
    emb(torch.tensor([3]))            # no backward: its leaf has no gradient
    emb.step()
    after = torch.zeros(ROWS, DIM)
    kv.row_sparse_pull("e", out=after, row_ids=torch.arange(ROWS))
    torch.testing.assert_close(after, before)
    assert "40, 5" in repr(emb)


class Model(torch.nn.Module):
    def __init__(self, kv):
        super().__init__()
        self.emb = ShardedEmbedding(ROWS, DIM, kv, key="emb", init=("normal", 0.1), seed=3)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).sum()


def test_a_model_with_a_sharded_table_trains_with_model_parameters_and_pickles():
    """The Trainer takes model.parameters() beside the table's str key (its keys are
    then str too), and torch.save(model) works: the table stays on the servers and
    the loaded module asks for its store by name until one is attached."""
    import io
    torch.manual_seed(0)
    kv = kvstore.create("local")
    kv.set_optimizer(opt.SGD(learning_rate=LR))          # the table's optimizer (servers update it)
    model = Model(kv)
    trainer = kvstore.torch.Trainer(model.parameters(), kv, torch.optim.SGD(model.parameters(), lr=LR))
    assert kv.key_type is str
    ids = torch.tensor([[1, 2], [2, 7]])
    for _ in range(2):
        trainer.zero_grad()
        model(ids).backward()
        trainer.step()
        model.emb.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with pytest.raises(RuntimeError, match="ShardedEmbedding 'emb' has no store .* set emb.kv = kv"):
        loaded(ids)
    loaded.emb.kv = kv
    assert torch.equal(loaded(ids), model(ids))

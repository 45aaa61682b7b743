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


def pulled(kv, key="emb"):
    table = torch.zeros(ROWS, DIM)
    kv.row_sparse_pull(key, out=table, row_ids=torch.arange(ROWS))
    return table


def test_the_table_is_the_modules_weight_in_state_dict_and_load_state_dict():
    """state_dict() holds the table as "weight" (nn.Embedding's name) beside the
    other modules' tensors; load_state_dict() sends it to the store that holds the
    table; a table of another shape is refused naming it, and nothing changes."""
    kv = kvstore.create("local")
    model = Model(kv)
    state = model.state_dict()
    assert list(state) == ["emb.weight", "head.weight", "head.bias"]
    torch.testing.assert_close(state["emb.weight"], pulled(kv))
    other_kv = kvstore.create("local")
    torch.manual_seed(1)
    other = Model(other_kv)
    other_kv.assign_rows("emb", kvstore.RowSparse(torch.zeros(ROWS, DIM), torch.arange(ROWS), (ROWS, DIM)))
    assert not torch.equal(pulled(other_kv), pulled(kv))
    other.load_state_dict(state)
    ids = torch.tensor([[0, 39], [5, 5]])
    assert torch.equal(other(ids), model(ids))
    before = pulled(other_kv)
    with pytest.raises(RuntimeError, match=r"size mismatch for emb.weight: copying a param with shape \(41, 5\)"):
        other.load_state_dict({**state, "emb.weight": torch.zeros(ROWS + 1, DIM)})
    with pytest.raises(RuntimeError, match='Missing key.*"emb.weight"'):
        other.load_state_dict({k: v for k, v in state.items() if k != "emb.weight"})
    assert torch.equal(pulled(other_kv), before)


def test_a_dist_job_resumes_from_a_state_dict_on_fresh_servers(make_cluster, tmp_path):
    """Two steps, torch.save(model.state_dict()) on rank 0; a new job on fresh servers
    (a zero table) loads it on every worker (torch.load with mmap) and takes two more
    steps: the table is the one four uninterrupted steps give (plain SGD: no state)."""
    path = str(tmp_path / "model.pt")

    def steps(kv, emb, n, skip=0):
        kv.set_optimizer(opt.SGD(learning_rate=LR))
        for ids, target in batches(skip + n, kv.rank)[skip:]:
            (emb(ids).sum(1) - target).pow(2).sum().backward()
            emb.step()

    def uninterrupted(kv):
        emb = ShardedEmbedding(ROWS, DIM, kv, key="emb", init=("uniform", 0.5), seed=4)
        steps(kv, emb, 4)
        return pulled(kv)

    def first(kv):
        emb = ShardedEmbedding(ROWS, DIM, kv, key="emb", init=("uniform", 0.5), seed=4)
        steps(kv, emb, 2)
        kv.barrier()
        if kv.rank == 0:
            torch.save(emb.state_dict(), path)

    def resumed(kv):
        emb = ShardedEmbedding(ROWS, DIM, kv, key="emb", init=("zeros", 0.0))
        emb.load_state_dict(torch.load(path, mmap=True))
        steps(kv, emb, 2, skip=2)
        return pulled(kv)

    want = make_cluster(2, 3).run(uninterrupted)
    make_cluster(2, 3).run(first)
    got = make_cluster(2, 3).run(resumed)
    for table in got:
        torch.testing.assert_close(table, want[0], rtol=1e-6, atol=1e-6)


def test_save_table_and_load_table_stream_the_table_in_pieces(make_cluster, tmp_path):
    path = str(tmp_path / "table.npy")
    calls = {"assign": [], "pull": []}

    def job(kv):
        emb = ShardedEmbedding(ROWS, DIM, kv, key="emb", init=("normal", 0.3), seed=1)
        if kv.rank == 0:
            pull, assign = kv.row_sparse_pull, kv.assign_rows
            kv.row_sparse_pull = lambda *a, **k: (calls["pull"].append(len(k["row_ids"])), pull(*a, **k))[1]
            kv.assign_rows = lambda key, value: (calls["assign"].append(len(value.indices)), assign(key, value))[1]
            emb.save_table(path, piece_rows=7)
            kv.row_sparse_pull, kv.assign_rows = pull, assign
            fresh = ShardedEmbedding(ROWS, DIM, kv, key="spied", init=("zeros", 0.0))
            kv.assign_rows = lambda key, value: (calls["assign"].append(len(value.indices)), assign(key, value))[1]
        else:
            fresh = ShardedEmbedding(ROWS, DIM, kv, key="spied", init=("zeros", 0.0))
        fresh.load_table(path, piece_rows=6)
        kv.barrier()
        return pulled(kv), pulled(kv, "spied")

    import numpy as np
    for want, got in make_cluster(2, 2).run(job):
        assert torch.equal(got, want)
        assert np.array_equal(np.load(path), want.numpy())
    # rank 0 pulled and sent the table 7 and 6 rows at a time; the others sent nothing
    assert calls["pull"] == [7] * 5 + [5] and calls["assign"] == [6] * 6 + [4]

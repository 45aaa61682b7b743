"""DLRM against TorchRec on CPU (issue 32): one model, two ways to hold its tables.

    python -m benchmarks.dlrm.run --workers 2,4,8 --steps 40 --record

- :mod:`benchmarks.dlrm.data`: the seeded batches (dense features, Zipf ids per
  table, labels from a fixed random teacher) and the seeded initial values
  (numpy only: both contenders' environments import it);
- :mod:`benchmarks.dlrm.model`: DLRM in plain torch (bottom MLP, pooled embedding
  bags, pairwise dot interaction, top MLP, BCE loss) with a pluggable embedding;
- :mod:`benchmarks.dlrm.ours`: a worker of ours (``ShardedEmbedding`` + ``Trainer``,
  under ``python -m tracker.local``);
- :mod:`benchmarks.dlrm.torchrec_worker`: a TorchRec worker
  (``EmbeddingBagCollection`` + ``DistributedModelParallel``, default planner, gloo),
  run by ``torchrun`` from ``benchmarks/.venv-torchrec``;
- :mod:`benchmarks.dlrm.run`: runs both at each W, alternating, and writes
  ``dlrm.json`` and ``dlrm.md``.
"""

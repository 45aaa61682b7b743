"""The GPU benchmark's server rounds (benchmarks/gpu_check.py) run in CI on the host
backend, so a renamed method or a changed signature of the server state fails
here, not on the next GPU loan (issue 29, defect 2)."""

import numpy as np
import pytest

from benchmarks.gpu_check import server_rounds
from kvstore import optimizer as opt
from kvstore.server.backend import HostBackend


@pytest.mark.parametrize("optimizer", [None, opt.SGD(learning_rate=0.1, momentum=0.9)], ids=["sum", "sgd"])
def test_one_benchmark_round_applies_one_sync_round_on_every_chunk(optimizer):
    state, one_round = server_rounds(HostBackend(), np, n=1000, count=3, workers=2, optimizer=optimizer)
    one_round()
    one_round()
    total = 0.5 + 1.0                                  # worker 0 pushes 0.5, worker 1 pushes 1.0
    if optimizer is None:
        want = total                                   # no optimizer: the round's sum is assigned
    else:
        mom = -0.1 * total
        mom = 0.9 * mom - 0.1 * total
        want = -0.1 * total + mom
    for i in range(3):
        np.testing.assert_allclose(state.chunks[("k", i)].value, want, rtol=1e-6)
        assert not state.chunks[("k", i)].rounds            # nothing left waiting

"""A server checkpoint records what its optimizer state means (``state_version``,
kvstore.optimizer.STATE_VERSION): NAG's momentum became MXNet's (``m*mom - lr*g``)
in version 2; a checkpoint that kept version 1 (or predates the field) is read in
today's meaning, and one of an unknown version is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import optimizer
from kvstore.errors import CheckpointError
from kvstore.server.state import ServerState
from state_driver import A, Server, vec

pytestmark = pytest.mark.timeout(60)

LR = 0.1


def _trained() -> tuple[dict, np.ndarray]:
    srv = Server(num_workers=1, opt=optimizer.NAG(learning_rate=LR, momentum=0.9), init={A: vec(1.0, 2.0)})
    for g in (vec(1.0, -1.0), vec(0.5, 2.0)):
        srv.push(0, {A: g})
    mom = srv.state.updater.get_states()[A]["state"][-1].copy()
    return srv.state.snapshot({}), mom


def _restored(snap: dict) -> np.ndarray:
    state = ServerState(name="server 0")
    state.restore(snap)
    return np.asarray(state.updater.get_states()[A]["state"][-1])


def _as_version_1(snap: dict, mom: np.ndarray, keep_field: bool) -> dict:
    """The same checkpoint as version 1 wrote it: the momentum without the rate."""
    chunks = [[*c[:5], [(mom / -LR).astype(mom.dtype).tobytes()]] if (c[0], c[1]) == A else c
              for c in snap["chunks"]]
    old = {**snap, "chunks": chunks}
    if keep_field:
        old["state_version"] = 1
    else:
        old.pop("state_version")
    return old


def test_a_checkpoint_records_its_state_version_and_restores_it_as_it_was():
    snap, mom = _trained()
    assert snap["state_version"] == optimizer.STATE_VERSION == 2
    np.testing.assert_array_equal(_restored(snap), mom)


@pytest.mark.parametrize("keep_field", [True, False], ids=["version-1", "no-field"])
def test_a_version_1_checkpoint_is_read_in_todays_meaning(keep_field):
    snap, mom = _trained()
    np.testing.assert_allclose(_restored(_as_version_1(snap, mom, keep_field)), mom, rtol=1e-6)
    # read as if it were today's, the momentum would be 1/lr = 10 times too large, of the other sign
    assert not np.allclose(mom / -LR, mom, rtol=1e-6)


def test_an_unknown_state_version_is_refused_by_name():
    snap, _ = _trained()
    with pytest.raises(CheckpointError, match="optimizer state version 99 is unknown"):
        _restored({**snap, "state_version": 99})

"""The base of LARS and LAMB: an optimizer whose step is scaled per key by norms
over the whole key, run in two phases where the key is cut over servers
(kvstore.optimizer.layerwise has the norms' helpers and the rules)."""

from __future__ import annotations

from .base import Optimizer
from .layerwise import check_whole

__all__ = ["LayerwiseOptimizer"]


class LayerwiseOptimizer(Optimizer):
    """An optimizer whose step is scaled per key by norms over the whole key, in the
    two phases of :attr:`~kvstore.optimizer.Optimizer.splits_norms` (LARS, LAMB).

    A subclass gives :meth:`chunk_terms` (phase 1: a chunk's sums of squares and
    what phase 2 needs) and ``_apply`` (phase 2: the step with the key's sums);
    an update that sees the whole key runs both here, after :meth:`check_whole`.
    """

    splits_norms = True

    def needs_whole_keys(self) -> bool:
        return True

    def check_whole(self, index, rows) -> None:
        """Raise ValueError where this update would see only part of a key."""
        check_whole(type(self).__name__, index, rows)

    def _step_at(self, weight, grad, state, t, lr, xp, index, rows) -> None:
        self.check_whole(index, rows)
        terms, carry = self.chunk_terms(weight, grad, state, t, lr, xp, index)
        self._apply(weight, grad, state, t, lr, xp, index, terms, carry)

"""SGLD, stochastic gradient Langevin dynamics (MXNet 1.x ``SGLD``), with noise that
is a pure function of where and when it is drawn.

MXNet draws SGLD's noise from its process-wide generator, so a run depends on
the order in which parameters are updated. Here the noise for one element is
a counter-based draw keyed by ``(seed, index, t, position)``: the optimizer's
``seed``, the Updater's index, the weight's update count and the element's
flat position in the weight (for a lazy row-sparse update, the position the row's
elements have in the whole weight). It is computed with integer arithmetic that
NumPy and CuPy do alike (SplitMix64's mixer over 64-bit counters, then
Box-Muller), so a CPU server and a GPU server draw the same noise, restarts from
a checkpoint continue the same sequence, and the number of servers does not
matter. What it depends on: the weight's name and extent, which are the store's
(the ``local`` and ``device`` stores name a weight by its key; servers by
``(key, chunk index)`` for a dense key, whose chunks depend on
``KVSTORE_CHUNK_BYTES`` only, and ``(key, server)`` for a row-sparse key's rows
on one server, which depend on the number of servers).
"""

from __future__ import annotations

import hashlib
import math

from ._util import integer
from .base import Optimizer, register

__all__ = ["SGLD", "standard_normal"]

# SplitMix64 (Steele, Lea & Flood 2014): a Weyl sequence with this increment,
# each value put through a 64-bit mixer. Counters 2p+1 and 2p+2 give element p
# its two uniforms.
_GAMMA = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _stream(seed: int, index, t: int) -> int:
    # repr of the index (an int, str or tuple of those, as the Updater normalises it) is
    # stable across processes, unlike hash() of a str.
    digest = hashlib.blake2b(repr((seed, index, t)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _uniform53(base, counters, xp):
    """Integers in [0, 2**53) from SplitMix64's outputs at ``counters`` (uint64)."""
    z = counters * xp.uint64(_GAMMA)     # uint64 arithmetic wraps, as SplitMix64 needs
    z += base
    z ^= z >> xp.uint64(30)
    z *= xp.uint64(_MIX[0])
    z ^= z >> xp.uint64(27)
    z *= xp.uint64(_MIX[1])
    z ^= z >> xp.uint64(31)
    return (z >> xp.uint64(11)).astype(xp.float64)


def standard_normal(seed: int, index, t: int, positions, xp):
    """float64 standard normal draws, one per entry of ``positions`` (an integer array
    of module ``xp``, any shape; the result has its shape), a pure function of
    ``(seed, index, t, position)`` that NumPy and CuPy compute alike.

    Example: ``standard_normal(0, ("w", 0), 1, numpy.arange(4), numpy)``
    """
    base = xp.uint64(_stream(seed, index, t))
    k = positions.astype(xp.uint64)
    k *= xp.uint64(2)
    u1 = _uniform53(base, k + xp.uint64(1), xp)
    u1 += 1.0
    u1 *= 2.0 ** -53                 # (0, 1]: the log below stays finite
    u2 = _uniform53(base, k + xp.uint64(2), xp)
    u2 *= 2.0 * math.pi * 2.0 ** -53
    xp.log(u1, out=u1)
    u1 *= -2.0
    xp.sqrt(u1, out=u1)
    xp.cos(u2, out=u2)
    u1 *= u2
    return u1


@register
class SGLD(Optimizer):
    """Stochastic gradient Langevin dynamics (Welling & Teh 2011; MXNet 1.x
    ``SGLD``); stateless::

        g = clip(g, c)
        w -= lr / 2 * (g + wd * w)
        w += sqrt(lr) * N(0, 1)

    The noise is drawn by :func:`standard_normal` keyed by ``seed`` (an int >= 0,
    not an MXNet parameter: MXNet uses its global generator), the weight, the update
    count and the element's position; the module docstring says what that makes
    it depend on. Raises ConfigError for a seed that is not an int >= 0. MXNet's
    default ``learning_rate``: 0.01.

    Example: ``SGLD(learning_rate=1e-4, wd=1e-3, seed=7)``
    """

    name = "sgld"
    kernel_clip = False      # MXNet clips in Python: clip_gradient must be None or > 0
    hyper_params = ("seed",)

    def __init__(self, *, seed: int = 0, **common) -> None:
        super().__init__(**common)
        self.seed = integer(type(self).__name__, "seed", seed, lo=0)

    def _step_at(self, weight, grad, state, t: int, lr: float, xp, index, rows) -> None:
        g = self._rescaled_grad(weight, grad, xp, wd_before_clip=False)
        if self.wd:
            g += self.wd * weight
        g *= lr / 2.0
        weight -= g
        if rows is None:
            positions = xp.arange(weight.size, dtype=xp.uint64).reshape(weight.shape)
        else:   # weight is rows of a 2-d weight: their elements' positions in the weight
            width = weight.shape[1] if weight.ndim == 2 else 1
            positions = xp.asarray(rows).astype(xp.uint64).reshape(-1, 1) * xp.uint64(width)
            positions = (positions + xp.arange(width, dtype=xp.uint64)).reshape(weight.shape)
        noise = standard_normal(self.seed, index, t, positions, xp)
        noise *= math.sqrt(lr)
        # MXNet draws the noise in the weight's dtype; here it is rounded to it
        weight += noise.astype(weight.dtype)

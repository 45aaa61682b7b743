"""MXNet 1.9.1's reference optimizers and comparison tolerances, in NumPy; not collected.

A translation of what tests/python/unittest/test_optimizer.py (MXNet 1.9.1, Apache
License 2.0) compares MXNet's optimizers with: its pure-Python optimizers ``PySGD``,
``PySparseSGD``, ``PyNAG``, ``PyLAMB``, ``PySGLD``, ``PyFTML``, ``PyAdam``,
``PyAdamax``, ``PySignum``, ``PyRMSProp``, ``PyFtrl``, ``PyAdaGrad`` and ``PyAdaDelta``
(NDArray arithmetic over NumPy arrays, statement for statement, in the same order and
dtypes), the part of ``mx.optimizer.Optimizer`` they inherit (learning rate, weight
decay, update counts, the float32 master copy of ``multi_precision``), and what
python/mxnet/test_utils.py's ``compare_optimizer`` uses: the data it draws (uniform
weights and gradients, ``rand_ndarray``'s row-sparse and CSR arrays), its default
tolerances and ``assert_almost_equal``'s test (``numpy.allclose(ref, ours, rtol,
atol)``). test_mxnet_unittest_port.py drives kvstore.optimizer against these.

Translation notes: an NDArray expression ``weight[:] = e`` is ``weight[...] = e`` (cast
into the weight's dtype); ``mx.nd.clip/sqrt/square/sign/abs/maximum`` are NumPy's; a
Python scalar times a float16 array stays float16 in both. ``mx.random.normal`` is
:attr:`PySGLD.normal`, which the test seeds as MXNet's ``mx.random.seed``.
"""

from __future__ import annotations

import math

import numpy as np

# -- test_utils.py: tolerances and the comparison ----------------------------------------

DEFAULT_RTOLS = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-5}
DEFAULT_ATOLS = {np.dtype(np.float16): 1e-1, np.dtype(np.float32): 1e-3, np.dtype(np.float64): 1e-20}


def tolerances(a, b, rtol=None, atol=None) -> tuple[float, float]:
    """test_utils.get_tols: a number is used as it is; None is the larger of the two
    arrays' dtype defaults."""
    if rtol is None:
        rtol = max(DEFAULT_RTOLS[np.dtype(a.dtype)], DEFAULT_RTOLS[np.dtype(b.dtype)])
    if atol is None:
        atol = max(DEFAULT_ATOLS[np.dtype(a.dtype)], DEFAULT_ATOLS[np.dtype(b.dtype)])
    return rtol, atol


def almost_equal(a, b, rtol=None, atol=None) -> bool:
    """assert_almost_equal's test (a: the reference, b: the optimizer under test)."""
    rtol, atol = tolerances(a, b, rtol, atol)
    return bool(np.allclose(a, b, rtol=rtol, atol=atol))


def assert_almost_equal(a, b, rtol=None, atol=None, what="") -> None:
    if almost_equal(a, b, rtol, atol):
        return
    rtol, atol = tolerances(a, b, rtol, atol)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    excess = np.abs(a64 - b64) - (atol + rtol * np.abs(b64))
    i = np.unravel_index(int(np.nanargmax(np.where(np.isnan(excess), np.inf, excess))), excess.shape)
    raise AssertionError(f"{what}: not within rtol={rtol:g}, atol={atol:g} at {i}: reference {a64[i]!r}, "
                         f"ours {b64[i]!r} ({int(np.sum(~np.isclose(a64, b64, rtol, atol)))} of {a.size} "
                         "elements differ)")


def compare_ndarray_tuple(t1, t2, rtol=None, atol=None, what="state") -> None:
    """test_utils.compare_ndarray_tuple: nested tuples compared leaf by leaf; a None on
    either side is skipped."""
    if t1 is None or t2 is None:
        return
    if isinstance(t1, tuple):
        if not isinstance(t2, tuple) or len(t1) != len(t2):
            raise AssertionError(f"{what}: the reference's state {_layout(t1)} is not ours {_layout(t2)}")
        for k, (s1, s2) in enumerate(zip(t1, t2)):
            compare_ndarray_tuple(s1, s2, rtol, atol, f"{what}[{k}]")
    else:
        assert_almost_equal(t1, t2, rtol, atol, what)


def _layout(t):
    if isinstance(t, tuple):
        return "(" + ", ".join(_layout(s) for s in t) + ")"
    return "None" if t is None else f"{t.dtype}{t.shape}"


def leaves(t) -> list:
    """The arrays of a (nested) state, depth first, Nones left out."""
    if t is None:
        return []
    if isinstance(t, tuple):
        return [a for s in t for a in leaves(s)]
    return [t]


def nest_like(t, arrays: list):
    """``t``'s nesting with its arrays replaced, in :func:`leaves` order, by ``arrays``
    (consumed from the front); Nones stay."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(nest_like(s, arrays) for s in t)
    return arrays.pop(0)


# -- test_utils.py: the data compare_optimizer draws ---------------------------------------

def uniform(rng, shape, dtype):
    """mx.random.uniform(shape=shape, dtype=dtype): [0, 1) drawn in float32 (MXNet's
    generator), rounded to ``dtype``."""
    return rng.random(shape, dtype=np.float32).astype(dtype)


def rand_row_sparse(rng, shape, dtype, density=None):
    """rand_sparse_ndarray(shape, 'row_sparse', density): each row kept with probability
    ``density`` (itself uniform when None), its values uniform [0, 1). Returns the
    dense array (zero rows elsewhere) and the kept rows' ids."""
    density = rng.random() if density is None else density
    rows = np.flatnonzero(rng.random(shape[0]) < density)
    dense = np.zeros(shape, dtype)
    dense[rows] = rng.random((len(rows),) + tuple(shape[1:])).astype(dtype)
    return dense, rows


def rand_csr(rng, shape, dtype, density=None):
    """rand_ndarray(shape, 'csr', density) as a dense array: ``round(density * size)``
    distinct elements uniform [0, 1), zeros elsewhere (scipy.sparse.rand's)."""
    density = rng.random() if density is None else density
    size = int(np.prod(shape))
    nnz = int(round(density * size))
    flat = np.zeros(size, dtype)
    flat[rng.choice(size, nnz, replace=False)] = rng.random(nnz).astype(dtype)
    return flat.reshape(shape)


def _zero_row(row) -> bool:
    # test_utils.almost_equal(row, zeros) with its defaults for float64 (rtol 1e-5, atol 1e-20)
    return bool(np.allclose(row, np.zeros_like(row), rtol=1e-5, atol=1e-20))


# -- mx.optimizer.Optimizer, as the references inherit it ----------------------------------

class PyOptimizer:
    """The part of MXNet 1.9.1's ``Optimizer`` the references use: ``learning_rate`` (None:
    0.01), ``wd``, ``rescale_grad``, ``clip_gradient``, ``multi_precision``, the update
    counts by index, and ``create_state_multi_precision`` / ``update_multi_precision``
    (a float16 weight with ``multi_precision`` updated through a float32 master copy,
    the state ``(master, state)``)."""

    def __init__(self, rescale_grad=1.0, wd=0.0, clip_gradient=None, learning_rate=None,
                 lr_scheduler=None, begin_num_update=0, multi_precision=False):
        self.rescale_grad = rescale_grad
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is None and learning_rate is None:
            learning_rate = 0.01
        self.lr = learning_rate
        self.wd = wd
        self.begin_num_update = begin_num_update
        self.num_update = begin_num_update
        self._index_update_count: dict = {}
        self.clip_gradient = clip_gradient
        self.multi_precision = multi_precision

    def _update_count(self, index):
        if index not in self._index_update_count:
            self._index_update_count[index] = self.begin_num_update
        self._index_update_count[index] += 1
        self.num_update = max(self._index_update_count[index], self.num_update)

    def _get_lr(self, index):
        return self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr

    def _get_wd(self, index):
        return self.wd

    def create_state(self, index, weight):
        raise NotImplementedError

    def update(self, index, weight, grad, state):
        raise NotImplementedError

    def create_state_multi_precision(self, index, weight):
        if self.multi_precision and weight.dtype == np.float16:
            master = weight.astype(np.float32)
            return (master,) + (self.create_state(index, master),)
        return self.create_state(index, weight)

    def update_multi_precision(self, index, weight, grad, state):
        if self.multi_precision and weight.dtype == np.float16:
            master, inner = state[0], state[1]
            self.update(index, master, grad.astype(np.float32), inner)
            weight[...] = master.astype(weight.dtype)
        else:
            self.update(index, weight, grad, state)

    def state_order(self, multi_precision: bool) -> list[int] | None:
        """For each of this reference's state arrays (in :func:`leaves` order), the
        index of the same array in the state kvstore.optimizer keeps (its master copy
        first, then its state); None: the same order."""
        return None


# -- the references ----------------------------------------------------------------------

class PySGD(PyOptimizer):
    """test_optimizer.py's PySGD; its multi_precision state is ``(mom, weight32)``."""

    def __init__(self, learning_rate=0.01, momentum=0.0, multi_precision=False, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum
        self.multi_precision = multi_precision

    def create_state(self, index, weight):
        momentum = None
        if self.multi_precision and weight.dtype == np.float16:
            if self.momentum != 0.0:
                momentum = np.zeros(weight.shape, np.float32)
            return (momentum, weight.astype(np.float32))
        if self.momentum != 0.0:
            momentum = np.zeros(weight.shape, weight.dtype)
        return momentum

    def create_state_multi_precision(self, index, weight):
        return self.create_state(index, weight)

    def state_order(self, multi_precision):
        # ours: (weight32, mom); PySGD's: (mom, weight32)
        return [1, 0] if multi_precision and self.momentum != 0.0 else None

    def update(self, index, weight, grad, state):
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        self._update_count(index)
        if not isinstance(state, (list, tuple)):
            if self.momentum == 0.0:
                if self.clip_gradient is not None:
                    weight[...] = ((1 - lr * wd) * weight
                                   - lr * np.clip(grad * self.rescale_grad, -self.clip_gradient, self.clip_gradient))
                else:
                    weight[...] = (1 - lr * wd) * weight - lr * self.rescale_grad * grad
            else:
                mom = state
                if self.clip_gradient is not None:
                    mom[...] = (self.momentum * mom - lr * wd * weight
                                - lr * np.clip(grad * self.rescale_grad, -self.clip_gradient, self.clip_gradient))
                    weight += mom
                else:
                    mom[...] = self.momentum * mom - lr * wd * weight - lr * self.rescale_grad * grad
                    weight += mom
        else:
            grad32 = grad.astype(np.float32)
            mom, weight32 = state[0], state[1]
            if self.momentum == 0.0:
                if self.clip_gradient is not None:
                    weight32[...] = ((1 - lr * wd) * weight32
                                     - lr * np.clip(grad32 * self.rescale_grad, -self.clip_gradient,
                                                    self.clip_gradient))
                else:
                    weight32[...] = (1 - lr * wd) * weight32 - lr * self.rescale_grad * grad32
            else:
                if self.clip_gradient is not None:
                    mom[...] = (self.momentum * mom - lr * wd * weight32
                                - lr * np.clip(grad32 * self.rescale_grad, -self.clip_gradient,
                                               self.clip_gradient))
                    weight32 += mom
                else:
                    mom[...] = self.momentum * mom - lr * wd * weight32 - lr * self.rescale_grad * grad32
                    weight32 += mom
            weight[...] = weight32.astype(weight.dtype)

    def update_multi_precision(self, index, weight, grad, state):
        self.update(index, weight, grad, state)


class PySparseSGD(PyOptimizer):
    """test_optimizer.py's PySparseSGD: SGD row by row, rows whose gradient is all
    zeros skipped (MXNet's lazy update)."""

    def __init__(self, learning_rate=0.01, momentum=0.0, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def create_state(self, index, weight):
        return None if self.momentum == 0.0 else np.zeros(weight.shape, weight.dtype)

    def update(self, index, weight, grad, state):
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        self._update_count(index)
        for row in range(weight.shape[0]):
            if _zero_row(grad[row]):
                continue
            if self.momentum == 0.0:
                if self.clip_gradient is not None:
                    weight[row] = ((1 - lr * wd) * weight[row]
                                   - lr * np.clip(grad[row] * self.rescale_grad, -self.clip_gradient,
                                                  self.clip_gradient))
                else:
                    weight[row] = (1 - lr * wd) * weight[row] - lr * self.rescale_grad * grad[row]
            else:
                mom = state
                if self.clip_gradient is not None:
                    mom[row] = (self.momentum * mom[row] - lr * wd * weight[row]
                                - lr * np.clip(grad[row] * self.rescale_grad, -self.clip_gradient,
                                               self.clip_gradient))
                else:
                    mom[row] = self.momentum * mom[row] - lr * wd * weight[row] - lr * self.rescale_grad * grad[row]
                weight[row] += mom[row]


class PyNAG(PySGD):
    """test_optimizer.py's PyNAG (its momentum includes the rate; the second wd term
    reads the weight just updated)."""

    def update(self, index, weight, grad, state):
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        self._update_count(index)
        m = self.momentum
        if not isinstance(state, (list, tuple)):
            grad = grad * self.rescale_grad
            if self.clip_gradient is not None:
                grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
            if m == 0.0:
                weight[...] += -lr * (grad + wd * weight)
            else:
                mom = state
                weight[...] += (m ** 2 * mom) - lr * (m + 1) * (grad + wd * weight)
                mom[...] = (m * mom) - lr * (grad + wd * weight)
        else:
            grad32 = grad.astype(np.float32) * self.rescale_grad
            if self.clip_gradient is not None:
                grad32 = np.clip(grad32, -self.clip_gradient, self.clip_gradient)
            mom, weight32 = state[0], state[1]
            if m == 0.0:
                weight32[...] += -lr * (grad32 + wd * weight32)
            else:
                weight32[...] += (m ** 2 * mom) - lr * (m + 1) * (grad32 + wd * weight32)
                mom[...] = (m * mom) - lr * (grad32 + wd * weight32)
            weight[...] = weight32.astype(weight.dtype)


class PyLAMB(PyOptimizer):
    """test_optimizer.py's PyLAMB."""

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-6,
                 lower_bound=None, upper_bound=None, bias_correction=True, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.lower_bound, self.upper_bound = lower_bound, upper_bound
        self.bias_correction = bias_correction

    def create_state(self, index, weight):
        return (np.zeros(weight.shape, weight.dtype), np.zeros(weight.shape, weight.dtype))

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        t = self._index_update_count[index]
        mean, var = state
        grad *= self.rescale_grad
        if self.clip_gradient is not None:
            grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
        mean[...] = self.beta1 * mean + (1. - self.beta1) * grad
        var[...] = self.beta2 * var + (1. - self.beta2) * np.square(grad)
        mean_hat, var_hat = mean, var
        r1 = np.linalg.norm(weight)               # NDArray.norm(): the L2 norm, in the weight's dtype
        if self.lower_bound:
            r1 = np.maximum(r1, self.lower_bound)
        if self.upper_bound:
            r1 = np.minimum(r1, self.upper_bound)
        if self.bias_correction:
            mean_hat = mean / (1. - self.beta1 ** t)
            var_hat = var / (1. - self.beta2 ** t)
        g = mean_hat / (np.sqrt(var_hat) + self.epsilon) + wd * weight
        r2 = np.linalg.norm(g)
        r = 1. if r1 == 0. or r2 == 0. else r1 / r2
        lr *= r
        weight[...] -= lr * g


class PySGLD(PyOptimizer):
    """test_optimizer.py's PySGLD; ``normal(loc, scale, shape, dtype)`` is
    ``mx.random.normal`` (set by the test, seeded as MXNet's generator)."""

    normal = None

    def create_state(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        grad = grad * self.rescale_grad
        if self.clip_gradient is not None:
            grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
        weight[...] += -lr / 2 * (grad + wd * weight) + self.normal(0, math.sqrt(lr), weight.shape, weight.dtype)


class PyFTML(PyOptimizer):
    """test_optimizer.py's PyFTML (state ``(d, v, z)``)."""

    def __init__(self, beta1=0.6, beta2=0.999, epsilon=1e-8, **kwargs):
        super().__init__(**kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index, weight):
        return tuple(np.zeros(weight.shape, weight.dtype) for _ in range(3))

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        t = self._index_update_count[index]
        grad = grad * self.rescale_grad + wd * weight
        if self.clip_gradient is not None:
            grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
        prev_d, prev_v, prev_z = state
        v_t = self.beta2 * prev_v + (1 - self.beta2) * np.square(grad)
        d_t = (1 - pow(self.beta1, t)) / lr * (np.sqrt(v_t / (1 - pow(self.beta2, t))) + self.epsilon)
        sigma_t = d_t - self.beta1 * prev_d
        z_t = self.beta1 * prev_z + (1 - self.beta1) * grad - sigma_t * weight
        weight[...] = - z_t / d_t
        prev_d[...] = d_t
        prev_v[...] = v_t
        prev_z[...] = z_t


class PyAdam(PyOptimizer):
    """test_optimizer.py's PyAdam: row by row, a row whose gradient is all zeros
    skipped when ``lazy_update``."""

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, lazy_update=True, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.lazy_update = lazy_update

    def create_state(self, index, weight):
        return (np.zeros(weight.shape, weight.dtype), np.zeros(weight.shape, weight.dtype))

    def update(self, index, weight, grad, state):
        lr = self._get_lr(index)
        self._update_count(index)
        t = self._index_update_count[index]
        mean, variance = state
        wd = self._get_wd(index)
        coef1 = 1. - self.beta1 ** t
        coef2 = 1. - self.beta2 ** t
        lr *= math.sqrt(coef2) / coef1
        for row in range(weight.shape[0]):
            if _zero_row(grad[row]) and self.lazy_update:
                continue
            grad[row] = grad[row] * self.rescale_grad + wd * weight[row]
            if self.clip_gradient is not None:
                np.clip(grad[row], -self.clip_gradient, self.clip_gradient, out=grad[row])
            mean[row] *= self.beta1
            mean[row] += grad[row] * (1. - self.beta1)
            variance[row] *= self.beta2
            variance[row] += (1 - self.beta2) * np.square(grad[row], out=grad[row])
            weight[row] -= lr * mean[row] / (np.sqrt(variance[row]) + self.epsilon)


class PyAdamax(PyOptimizer):
    """test_optimizer.py's PyAdamax."""

    def __init__(self, learning_rate=0.002, beta1=0.9, beta2=0.999, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2 = beta1, beta2

    def create_state(self, index, weight):
        return (np.zeros(weight.shape, weight.dtype), np.zeros(weight.shape, weight.dtype))

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        t = self._index_update_count[index]
        lr /= (1. - self.beta1 ** t)
        grad = grad * self.rescale_grad + wd * weight
        if self.clip_gradient is not None:
            grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
        m_t, u_t = state
        m_t[...] = self.beta1 * m_t + (1. - self.beta1) * grad
        u_t[...] = np.maximum(self.beta2 * u_t, np.abs(grad))
        weight[...] -= lr * m_t / u_t


class PySignum(PyOptimizer):
    """test_optimizer.py's PySignum."""

    def __init__(self, learning_rate=0.01, momentum=0.9, wd_lh=0.0, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum
        self.wd_lh = wd_lh

    def create_state(self, index, weight):
        return np.zeros(weight.shape, weight.dtype) if self.momentum != 0.0 else None

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        if state is not None:
            mom = state
            if self.clip_gradient is not None:
                mom[...] = (self.momentum * mom - (1 - self.momentum) * (
                    wd * weight + np.clip(grad * self.rescale_grad, -self.clip_gradient, self.clip_gradient)))
            else:
                mom[...] = (self.momentum * mom - (1 - self.momentum) * wd * weight
                            - (1 - self.momentum) * self.rescale_grad * grad)
            weight[...] = (1 - lr * self.wd_lh) * weight + lr * np.sign(mom)
        else:
            weight[...] = (1 - lr * (wd + self.wd_lh)) * weight - lr * np.sign(grad)


class PyRMSProp(PyOptimizer):
    """test_optimizer.py's PyRMSProp (its state is float32, MXNet's default dtype)."""

    def __init__(self, learning_rate=0.001, gamma1=0.9, gamma2=0.9, epsilon=1e-8, centered=False,
                 clip_weights=None, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.centered = centered
        self.gamma1, self.gamma2, self.epsilon = gamma1, gamma2, epsilon
        self.clip_weights = clip_weights

    def create_state(self, index, weight):
        return tuple(np.zeros(weight.shape, np.float32) for _ in range(3 if self.centered else 1))

    def update(self, index, weight, grad, state):
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        self._update_count(index)
        grad = grad * self.rescale_grad + wd * weight
        if not self.centered:
            (n,) = state
            if self.clip_gradient is not None:
                grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
            n[...] = (1 - self.gamma1) * (grad * grad) + self.gamma1 * n
            weight[...] -= lr * grad / (np.sqrt(n + self.epsilon))
        else:
            n, g, delta = state
            if self.clip_gradient is not None:
                grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
            n[...] = (1 - self.gamma1) * (grad * grad) + self.gamma1 * n
            g[...] = (1 - self.gamma1) * grad + self.gamma1 * g
            delta[...] = (self.gamma2) * delta - lr * grad / (np.sqrt(n - g * g + self.epsilon))
            weight[...] += delta
        if self.clip_weights:
            np.clip(weight, -self.clip_weights, self.clip_weights, out=weight)


class PyFtrl(PyOptimizer):
    """test_optimizer.py's PyFtrl (row by row; with ``lazy_update`` a row whose gradient
    is all zeros is skipped). As there, its rate is ``self.lr``, the ``learning_rate``."""

    def __init__(self, lamda1=0.01, learning_rate=0.1, beta=1, lazy_update=False, **kwargs):
        super().__init__(**kwargs)
        self.lamda1 = lamda1
        self.beta = beta
        self.lr = learning_rate
        self.lazy_update = lazy_update

    def create_state(self, index, weight):
        return (np.zeros(weight.shape, weight.dtype), np.zeros(weight.shape, weight.dtype))

    def update(self, index, weight, grad, state):
        self._update_count(index)
        wd = self._get_wd(index)
        lr = self._get_lr(index)
        dn, n = state
        for row in range(weight.shape[0]):
            if _zero_row(grad[row]) and self.lazy_update:
                continue
            grad[row] = grad[row] * self.rescale_grad
            if self.clip_gradient is not None:
                np.clip(grad[row], -self.clip_gradient, self.clip_gradient, out=grad[row])
            dn[row] += grad[row] - (np.sqrt(n[row] + grad[row] * grad[row]) - np.sqrt(n[row])) * weight[row] / lr
            n[row] += grad[row] * grad[row]
            weight[row] = ((np.sign(dn[row]) * self.lamda1 - dn[row])
                           / ((self.beta + np.sqrt(n[row])) / lr + wd) * (np.abs(dn[row]) > self.lamda1))


class PyAdaGrad(PyOptimizer):
    """test_optimizer.py's PyAdaGrad (its state is float32, MXNet's default dtype)."""

    def __init__(self, eps=1e-7, **kwargs):
        super().__init__(**kwargs)
        self.float_stable_eps = eps

    def create_state(self, index, weight):
        return np.zeros(weight.shape, np.float32)

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        history = state
        grad = grad * self.rescale_grad
        if self.clip_gradient is not None:
            grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
        history[...] += np.square(grad)
        div = grad / np.sqrt(history + self.float_stable_eps)
        weight[...] += (div + weight * wd) * -lr


class PyAdaDelta(PyOptimizer):
    """test_optimizer.py's PyAdaDelta (its state is float32, MXNet's default dtype)."""

    def __init__(self, rho=0.90, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.rho = rho
        self.epsilon = epsilon

    def create_state(self, index, weight):
        return (np.zeros(weight.shape, np.float32), np.zeros(weight.shape, np.float32))

    def update(self, index, weight, grad, state):
        self._update_count(index)
        wd = self._get_wd(index)
        grad *= self.rescale_grad
        if self.clip_gradient is not None:
            grad = np.clip(grad, -self.clip_gradient, self.clip_gradient)
        acc_grad, acc_delta = state
        acc_grad[...] = self.rho * acc_grad + (1. - self.rho) * grad ** 2
        current_delta = (np.sqrt(acc_delta + self.epsilon) / np.sqrt(acc_grad + self.epsilon)) * grad
        acc_delta[...] = self.rho * acc_delta + (1. - self.rho) * current_delta ** 2
        weight[...] -= current_delta + wd * weight

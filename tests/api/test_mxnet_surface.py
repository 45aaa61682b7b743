"""The rest of MXNet 1.9's KVStore surface: store names as MXNet matches them,
``is_capable``, ``_barrier``, ``KVStoreBase.register`` and the ``'test'``
optimizer of MXNet's own KVStore tests. Real stores: ``local`` and ``device`` in
process, ``dist_*`` on an in-process cluster (tests/cluster.py)."""

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from kvstore.worker.local import LocalStore
from kvstore.worker.device import DeviceStore
from kvstore.worker.types import _REGISTERED

SHAPE = (4, 4)
RATE = 2.0     # rescale_grad of MXNet's dist_sync_kvstore.py


@pytest.fixture
def registered():
    """Classes a test registers with KVStoreBase.register, forgotten afterwards."""
    classes = []
    yield classes
    for cls in classes:
        _REGISTERED.pop(cls.__name__)


# -- create(name) -------------------------------------------------------------------------

@pytest.mark.parametrize("name, cls, kind", [
    ("local", LocalStore, "local"), ("LOCAL", LocalStore, "local"), ("Local", LocalStore, "local"),
    ("local_allreduce_cpu", LocalStore, "local_allreduce_cpu"),
    ("Device", DeviceStore, "device"), ("local_allreduce_device", DeviceStore, "local_allreduce_device"),
])
def test_create_matches_names_in_any_case_and_mxnets_aliases(name, cls, kind):
    with kvstore.create(name) as kv:
        assert type(kv) is cls and kv.type == kind     # MXNet: the name given, lower-cased
        kv.init(3, np.ones(SHAPE, np.float32))
        kv.push(3, [np.ones(SHAPE, np.float32)] * 2)
        out = np.empty(SHAPE, np.float32)
        kv.pull(3, out=out)
        np.testing.assert_array_equal(out, 2.0)


@pytest.mark.parametrize("name, instead", [
    ("nccl", "'device'"), ("NCCL", "'device'"), ("horovod", "'dist_sync'"), ("byteps", "'dist_sync'"),
])
def test_mxnets_other_stores_say_what_to_use_instead(name, instead):
    with pytest.raises(ConfigError, match=f"store type {name!r}: .*{instead}"):
        kvstore.create(name)


def test_unknown_names_list_the_types_and_aliases():
    with pytest.raises(ConfigError, match="valid types: local, .*aliases: dist_sync_device, local_update_cpu"):
        kvstore.create("dist")        # MXNet's substring match would take this; we do not
    with pytest.raises(ArgumentTypeError):
        kvstore.create(None)


@pytest.mark.parametrize("name, mode", [("DIST_SYNC", "sync"), ("dist_sync_device", "sync"),
                                        ("Dist_Async", "async")])
def test_dist_names_in_any_case_and_the_device_alias(make_cluster, name, mode):
    cluster = make_cluster(2, 1)

    def job(kv):
        kv.init(3, np.ones(SHAPE, np.float32))
        kv.set_optimizer(opt.create("test", rescale_grad=RATE))
        kv.push(3, np.full(SHAPE, kv.rank + 1, np.float32))
        kv.barrier()
        out = np.empty(SHAPE, np.float32)
        kv.pull(3, out=out)
        return kv.type, type(kv).__name__, kv._mode.name, out

    for kind, cls, got_mode, out in cluster.run(job, store_type=name):
        assert kind == name.lower() and got_mode == mode
        assert cls == ("DistDeviceStore" if "device" in name else "DistStore")
        np.testing.assert_array_equal(out, 1 + RATE * (1 + 2))


# -- is_capable, _barrier ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["local", "device"])
def test_every_builtin_store_is_capable_of_optimizers(name):
    with kvstore.create(name) as kv:
        assert kv.is_capable(kvstore.KVStore.OPTIMIZER) is True
        assert kv.is_capable("Optimizer") is True          # MXNet lower-cases it
        with pytest.raises(InvalidArgumentError, match="unknown capability 'sparse'; known: 'optimizer'"):
            kv.is_capable("sparse")
        with pytest.raises(ValueError):                     # what MXNet raises
            kv.is_capable("compression")
        with pytest.raises(ArgumentTypeError):
            kv.is_capable(None)


def test_barrier_alias_orders_an_async_push_before_the_others_pull(make_cluster):
    """MXNet scripts call kv._barrier(): rank 0 pushes alone; after the barrier
    every worker reads the update (a barrier waits for the caller's pushes)."""
    cluster = make_cluster(3, 2)

    def job(kv):
        assert kv.is_capable(kvstore.KVStoreBase.OPTIMIZER)
        kv.init("w", np.ones(SHAPE, np.float32))
        kv.set_optimizer(opt.create("test", rescale_grad=RATE))
        if kv.rank == 0:
            kv.push("w", np.full(SHAPE, 5.0, np.float32))
        kv._barrier()
        out = np.empty(SHAPE, np.float32)
        kv.pull("w", out=out)
        return out

    for out in cluster.run(job, store_type="dist_async"):
        np.testing.assert_array_equal(out, 1 + RATE * 5)


# -- KVStoreBase.register ------------------------------------------------------------------------

class EchoStore(kvstore.KVStoreBase):
    """MXNet's TestStore: broadcast copies, pushpull sums a list of values; no optimizer."""

    def broadcast(self, key, value, out, priority=0):
        for o in out if isinstance(out, list) else [out]:
            o[...] = value

    def pushpull(self, key, value, out=None, priority=0):
        values = value if isinstance(value, list) else [value]
        total = sum(values[1:], values[0].copy())
        for o in values if out is None else (out if isinstance(out, list) else [out]):
            o[...] = total


def test_a_registered_store_is_created_by_its_class_name(registered):
    assert kvstore.KVStoreBase.register(EchoStore) is EchoStore
    registered.append(EchoStore)
    kv = kvstore.create("EchoStore")
    assert type(kv) is EchoStore and kv.type == "echostore" and (kv.rank, kv.num_workers) == (0, 1)
    assert kv.is_capable(kvstore.KVStoreBase.OPTIMIZER) is False       # as MXNet's TestStore
    out = np.empty(1, np.float32)
    kv.broadcast(1, np.ones(1, np.float32), out=out)
    assert out[0] == 1
    outs = [np.empty(1, np.float32), np.empty(1, np.float32)]
    kv.pushpull(1, [np.ones(1, np.float32)] * 2, out=outs)
    assert [o[0] for o in outs] == [2, 2]
    kv.pushpull(1, outs)
    assert [o[0] for o in outs] == [4, 4]
    assert kvstore.KVStoreBase.register(EchoStore) is EchoStore        # the same class again: fine
    with pytest.raises(ConfigError, match="registered: echostore"):
        kvstore.create("echo")


def test_a_registered_store_may_take_a_name_mxnet_keeps_for_a_wrapper(registered):
    @kvstore.KVStoreBase.register
    class Horovod(kvstore.KVStoreBase):
        capabilities = frozenset({kvstore.KVStoreBase.OPTIMIZER})
    registered.append(Horovod)
    kv = kvstore.create("horovod")
    assert type(kv) is Horovod and kv.is_capable("optimizer")


def test_a_registered_store_without_the_optional_methods_raises_not_implemented(registered):
    """MXNet's KVStoreBase declares broadcast, pushpull, set_optimizer and the
    optimizer-state files, each raising NotImplementedError (not AttributeError)."""
    @kvstore.KVStoreBase.register
    class Bare(kvstore.KVStoreBase):
        pass
    registered.append(Bare)
    kv = kvstore.create("bare")
    a = np.ones(2, np.float32)
    calls = {"broadcast": lambda: kv.broadcast(0, a, out=a), "pushpull": lambda: kv.pushpull(0, a),
             "set_optimizer": lambda: kv.set_optimizer(None),
             "save_optimizer_states": lambda: kv.save_optimizer_states("f"),
             "load_optimizer_states": lambda: kv.load_optimizer_states("f")}
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"Bare.{name}: this store type does not implement"):
            call()


def test_register_refuses_builtin_names_other_classes_and_taken_names(registered):
    class Local(kvstore.KVStoreBase):
        pass

    class Dist_Sync_Device(kvstore.KVStoreBase):
        pass

    for cls in (Local, Dist_Sync_Device):
        with pytest.raises(ConfigError, match="a built-in store type"):
            kvstore.KVStoreBase.register(cls)
    assert type(kvstore.create("local")) is LocalStore

    class Plain:
        pass

    with pytest.raises(ConfigError, match="expects a KVStoreBase subclass"):
        kvstore.KVStoreBase.register(Plain)

    class TakenStore(kvstore.KVStoreBase):
        pass
    kvstore.KVStoreBase.register(TakenStore)
    registered.append(TakenStore)
    other = type("TakenStore", (kvstore.KVStoreBase,), {})
    with pytest.raises(ConfigError, match="'takenstore' is already registered by .*TakenStore"):
        kvstore.KVStoreBase.register(other)
    assert type(kvstore.create("takenstore")) is TakenStore


# -- the 'test' optimizer ---------------------------------------------------------------------------

def test_the_test_optimizer_adds_the_rescaled_gradient_and_keeps_a_copy():
    """MXNet's Test: weight += rescale_grad * grad; state = weight. No lr, wd or clip."""
    o = opt.create("test", rescale_grad=0.5, learning_rate=7.0, wd=0.1, clip_gradient=0.01)
    w = np.arange(6, dtype=np.float32)
    g = np.full(6, 4.0, np.float32)
    state = o.create_state(w)
    assert len(state) == 1 and not state[0].any()
    o.update(w, g, state, 1)
    np.testing.assert_array_equal(w, np.arange(6) + 2.0)
    np.testing.assert_array_equal(state[0], w)
    assert state[0] is not w and (g == 4.0).all()
    assert opt.from_config(o.to_config()).to_config() == o.to_config()


def test_the_test_optimizer_keeps_a_float32_master_for_float16():
    o = opt.create("test", rescale_grad=1.0, multi_precision=True)
    w = np.zeros(3, np.float16)
    state = o.create_state(w)
    for _ in range(4):
        o.update(w, np.full(3, 1e-4, np.float16), state, 1)
    np.testing.assert_allclose(state[0], np.float32(np.float16(1e-4)) * 4, rtol=1e-6)
    assert w.dtype == np.float16 and w[0] == np.float16(state[0][0])


@pytest.mark.parametrize("kv_type", ["local_update_cpu", "local_allreduce_cpu", "local_allreduce_device"])
def test_mxnets_nightly_local_kvstore_test_with_the_test_optimizer(kv_type):
    """MXNet's nightly test_kvstore.py test_kvstore, ported: 'test' optimizer with
    lr .1, four devices' pushes per key, the result checked after every round."""
    rng = np.random.default_rng(0)
    keys, shapes, lr, devs, nrepeat = ["3", "5", "7"], [(4, 4), (100, 100), (2000,)], .1, 4, 10
    data = [[[(rng.random(s) * 2 - 1).astype(np.float32) for _ in range(devs)] for s in shapes]
            for _ in range(nrepeat)]
    with kvstore.create(kv_type) as kv:
        kv.set_optimizer(opt.create("test", rescale_grad=lr))
        for k, s in zip(keys, shapes):
            kv.init(k, np.zeros(s, np.float32))
        res = [np.zeros(s) for s in shapes]
        for i in range(nrepeat):
            for j, k in enumerate(keys):
                kv.push(k, data[i][j])
            res = [a + b * lr for a, b in zip(res, [sum(d.astype(np.float64) for d in row) for row in data[i]])]
            for j, k in enumerate(keys):
                out = [np.zeros(shapes[j], np.float32) for _ in range(devs)]
                kv.pull(k, out=out)
                err = sum(np.sum(np.abs(o - res[j])) for o in out) / np.sum(np.abs(res[j]))
                assert err < 1e-6, (err, shapes[j])


def test_mxnets_dist_sync_kvstore_with_the_test_optimizer(make_cluster):
    """MXNet's nightly dist_sync_kvstore.py check_default_keys, ported: every worker
    pushes ones * (rank + 1); after round i the value is 1 + rate * W(W+1)/2 * i."""
    workers = 3
    cluster = make_cluster(workers, 2, chunk_bytes=4096)

    def job(kv):
        kv.init(["3", "99"], [np.ones(SHAPE, np.float32), np.ones((40, 50), np.float32)])
        kv.set_optimizer(opt.create("test", rescale_grad=RATE))
        seen = []
        for i in range(3):
            for key, shape in (("3", SHAPE), ("99", (40, 50))):
                kv.push(key, np.ones(shape, np.float32) * (kv.rank + 1))
                out = np.empty(shape, np.float32)
                kv.pull(key, out=out)
                seen.append((i, out))
        return seen

    for seen in cluster.run(job):
        for i, out in seen:
            np.testing.assert_array_equal(out, (workers + 1) * workers * RATE / 2 * (i + 1) + 1)

"""multi_precision=True (MXNet's): float16 weights updated through a float32 master
copy kept in the optimizer state, on the local store and on the servers."""

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt

OPTIMIZERS = [opt.SGD(learning_rate=1e-3, momentum=0.9, wd=1e-4, multi_precision=True),
              opt.Adam(learning_rate=1e-4, multi_precision=True),
              opt.NAG(learning_rate=1e-3, momentum=0.9, multi_precision=True),
              # the rest of MXNet 1.9's element-wise optimizers (DCASGD's previous weight
              # is a copy of the master; SGLD's noise goes into the master)
              opt.DCASGD(learning_rate=1e-3, momentum=0.9, multi_precision=True),
              opt.SGLD(learning_rate=1e-4, multi_precision=True),
              opt.Ftrl(learning_rate=1e-2, multi_precision=True),
              opt.Nadam(learning_rate=1e-4, multi_precision=True)]


@pytest.mark.parametrize("o", OPTIMIZERS, ids=lambda o: o.name)
def test_a_float16_weight_is_the_float32_update_rounded(o):
    rng = np.random.default_rng(0)
    w16 = rng.standard_normal(1000).astype(np.float16)
    w32 = w16.astype(np.float32)
    u16, u32 = opt.Updater(o), opt.Updater(opt.from_config({**o.to_config(), "params": {
        **o.to_config()["params"], "multi_precision": False}}))
    for _ in range(20):
        g = rng.standard_normal(1000).astype(np.float16)
        u16(0, g, w16)
        u32(0, g.astype(np.float32), w32)
    np.testing.assert_array_equal(w16, w32.astype(np.float16))
    state = u16.get_states()[0]["state"]
    assert state[0].dtype == np.float32 and len(state) == o.num_states + 1
    np.testing.assert_array_equal(state[0], w32)          # the master copy is the float32 run


def test_small_updates_accumulate_in_the_master_copy_but_vanish_without_it():
    plain, multi = (opt.Updater(opt.SGD(learning_rate=1e-4, multi_precision=m)) for m in (False, True))
    w_plain, w_multi = np.ones(4, np.float16), np.ones(4, np.float16)
    for _ in range(10):
        plain(0, np.ones(4, np.float16), w_plain)
        multi(0, np.ones(4, np.float16), w_multi)
    assert (w_plain == 1.0).all()                          # 1 - 1e-4 rounds back to 1 in float16
    np.testing.assert_allclose(w_multi, np.float16(0.999), rtol=1e-3)


def test_state_spec_and_config():
    o = opt.Adam(multi_precision=True)
    assert o.state_spec(np.float16) == (3, np.dtype(np.float32))
    assert o.state_spec(np.float32) == (2, np.dtype(np.float32))
    assert opt.Adam().state_spec(np.float16) == (2, np.dtype(np.float16))
    assert opt.from_config(o.to_config()).multi_precision is True
    with pytest.raises(kvstore.ConfigError, match="multi_precision must be True or False"):
        opt.SGD(multi_precision="yes")


def fp16_job(kv, steps=4):
    kv.init("w", np.linspace(-1, 1, 3000).astype(np.float16))
    kv.set_optimizer(opt.SGD(learning_rate=1e-3, momentum=0.9, multi_precision=True))
    out = np.empty(3000, np.float16)
    for step in range(steps):
        kv.pushpull("w", np.full(3000, 0.25 * (kv.rank + 1 + step), np.float16), out=out)
    return out


def test_servers_keep_float32_master_weights_like_the_local_store(make_cluster, tmp_path):
    got = make_cluster(2, 2, chunk_bytes=4096).run(fp16_job)

    def local_twin(kv):       # one process pushing both workers' gradients as a list
        kv.init("w", np.linspace(-1, 1, 3000).astype(np.float16))
        kv.set_optimizer(opt.SGD(learning_rate=1e-3, momentum=0.9, multi_precision=True))
        out = np.empty(3000, np.float16)
        for step in range(4):
            kv.pushpull("w", [np.full(3000, 0.25 * (r + 1 + step), np.float16) for r in range(2)], out=out)
        return out
    with kvstore.create("local") as kv:
        want = local_twin(kv)
    for out in got:
        np.testing.assert_array_equal(out, want)


def test_float32_master_states_save_load_and_checkpoint(make_cluster, tmp_path):
    states, ckpt = str(tmp_path / "opt.states"), str(tmp_path / "ckpt")

    def first(kv):
        out = fp16_job(kv)
        kv.save_optimizer_states(states)
        kv.save_checkpoint({"step": 4})
        return out

    make_cluster(2, 1, checkpoint_dir=ckpt).run(first)

    def reload(kv):
        kv.init("w", np.zeros(3000, np.float16))
        kv.set_optimizer(opt.SGD(learning_rate=1e-3, momentum=0.9, multi_precision=True))
        kv.load_optimizer_states(states)           # float32 master copies for a float16 key
        kv.barrier()
        out = np.empty(3000, np.float16)
        kv.pull("w", out=out)
        return out
    for out in make_cluster(2, 1, checkpoint_dir=ckpt, resume=True).run(reload):
        assert np.isfinite(out).all()

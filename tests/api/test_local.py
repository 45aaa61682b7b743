"""The 'local' store: MXNet semantics and every bad input, with numpy and torch."""

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import ArgumentTypeError, ConfigError, InvalidArgumentError

torch = pytest.importorskip("torch")


def f32(*shape, fill=0.0):
    return np.full(shape, fill, np.float32)


@pytest.fixture
def kv():
    with kvstore.create("local") as store:
        yield store


def test_type_rank_and_size(kv):
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)


def test_push_list_sums_and_assigns(kv):
    kv.init(3, f32(2, 3, fill=1))
    kv.push(3, [f32(2, 3, fill=1), f32(2, 3, fill=2)])
    out = f32(2, 3)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, 3)
    kv.push(3, f32(2, 3, fill=5))          # no optimizer: assignment, not accumulation
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, 5)


def test_same_key_twice_in_one_list_sums(kv):
    kv.init(["a", "b"], [f32(4), f32(2)])
    kv.push(["a", "b", "a"], [f32(4, fill=1), f32(2, fill=7), [f32(4, fill=2), f32(4, fill=3)]])
    a, b = f32(4), f32(2)
    kv.pull(["a", "b"], out=[a, b])
    np.testing.assert_array_equal(a, 6)
    np.testing.assert_array_equal(b, 7)


def test_pull_fills_every_array_of_a_list(kv):
    kv.init(0, np.arange(6, dtype=np.float64).reshape(2, 3))
    outs = [np.zeros((2, 3)), np.zeros((2, 3))]
    kv.pull(0, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o, np.arange(6).reshape(2, 3))


def test_pushpull_writes_back_into_value_when_out_is_none(kv):
    kv.init(1, f32(3))
    g = f32(3, fill=2)
    kv.pushpull(1, g)
    np.testing.assert_array_equal(g, 2)
    out = f32(3)
    kv.pushpull(1, f32(3, fill=4), out=out)
    np.testing.assert_array_equal(out, 4)


def test_broadcast(kv):
    out = f32(5)
    kv.broadcast("emb", np.arange(5, dtype=np.float32), out=out)
    np.testing.assert_array_equal(out, np.arange(5))


def test_sgd_optimizer_applies_to_merged_gradient(kv):
    kv.init(0, f32(3, fill=10))
    kv.set_optimizer(opt.SGD(learning_rate=1.0))
    kv.push(0, [f32(3, fill=1), f32(3, fill=2)])
    out = f32(3)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out, 7)


def test_torch_tensors_in_and_out(kv):
    kv.init(7, torch.zeros(2, 2))
    kv.push(7, [torch.ones(2, 2, requires_grad=True), torch.ones(2, 2)])
    out = torch.empty(2, 2)
    kv.pull(7, out=out)
    assert torch.equal(out, torch.full((2, 2), 2.0))
    strided = torch.zeros(2, 4)[:, ::2]          # non-contiguous output
    kv.pull(7, out=strided)
    assert torch.equal(strided, torch.full((2, 2), 2.0))


def test_int_keys_are_64_bit(kv):
    big = (1 << 63) - 1
    kv.init([big, -big], [f32(1, fill=1), f32(1, fill=2)])
    out = f32(1)
    kv.pull(big, out=out)
    assert out[0] == 1
    with pytest.raises(InvalidArgumentError, match="64 bits"):
        kv.init(1 << 63, f32(1))


def test_save_and_load_optimizer_states_resume_exactly(kv, tmp_path):
    momentum = dict(learning_rate=0.1, momentum=0.9, wd=1e-3)
    kv.init(0, np.linspace(-1, 1, 8, dtype=np.float32))
    kv.set_optimizer(opt.SGD(**momentum))
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(8).astype(np.float32) for _ in range(4)]
    for g in grads[:2]:
        kv.push(0, g)
    path = tmp_path / "states.bin"
    kv.save_optimizer_states(str(path), dump_optimizer=True)
    saved_w = f32(8)
    kv.pull(0, out=saved_w)
    for g in grads[2:]:
        kv.push(0, g)
    expected = f32(8)
    kv.pull(0, out=expected)

    with kvstore.create("local") as kv2:
        kv2.init(0, saved_w)
        kv2.load_optimizer_states(str(path))   # the file carries the optimizer too
        for g in grads[2:]:
            kv2.push(0, g)
        got = f32(8)
        kv2.pull(0, out=got)
    np.testing.assert_array_equal(got, expected)


# ---- bad input: a clear error, nothing changed ----------------------------------

def test_unknown_store_type_lists_valid_ones():
    with pytest.raises(ConfigError, match="local, dist_sync, dist_async"):
        kvstore.create("dist_sink")
    with pytest.raises(ArgumentTypeError):
        kvstore.create(3)


def test_unknown_optimizer_lists_valid_ones():
    with pytest.raises(ConfigError, match="sgd"):
        opt.create("sgdd")


def test_dist_store_outside_a_job_explains_how_to_launch(monkeypatch):
    for name in ("KVSTORE_SCHEDULER_HOST", "DMLC_PS_ROOT_URI", "KVSTORE_SCHEDULER_PORT",
                 "DMLC_PS_ROOT_PORT", "KVSTORE_ROLE", "DMLC_ROLE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="tracker.local"):
        kvstore.create("dist_sync")


@pytest.mark.parametrize("call", [
    lambda kv: kv.push(99, f32(3)),
    lambda kv: kv.pull(99, out=f32(3)),
    lambda kv: kv.pushpull(99, f32(3)),
])
def test_uninitialised_key(kv, call):
    with pytest.raises(InvalidArgumentError, match="99.*not been initialised"):
        call(kv)


def test_init_twice_is_an_error_and_keeps_the_value(kv):
    kv.init(1, f32(3, fill=1))
    with pytest.raises(InvalidArgumentError, match="already initialised"):
        kv.init(1, f32(3, fill=9))
    with pytest.raises(InvalidArgumentError, match="already initialised"):
        kv.init([2, 2], [f32(3), f32(3)])
    out = f32(3)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, 1)
    with pytest.raises(InvalidArgumentError):
        kv.pull(2, out=out)   # the failed list init created nothing


@pytest.mark.parametrize("value, match", [
    (np.zeros((3, 1), np.float32), "shape"),
    (np.zeros(4, np.float32), "shape"),
    (np.zeros(3, np.float64), "dtype"),
    (torch.zeros(3, dtype=torch.int32), "dtype"),
])
def test_wrong_shape_or_dtype(kv, value, match):
    kv.init(1, f32(3, fill=1))
    with pytest.raises(InvalidArgumentError, match=match):
        kv.push(1, value)
    with pytest.raises(InvalidArgumentError, match=match):
        kv.push(1, [f32(3), value])          # one bad value in a list: nothing pushed
    with pytest.raises(InvalidArgumentError, match=match):
        kv.pull(1, out=value)
    out = f32(3)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, 1)


def test_mixing_int_and_str_keys(kv):
    kv.init(1, f32(1))
    with pytest.raises(ArgumentTypeError, match="mix"):
        kv.init("a", f32(1))
    with kvstore.create("local") as fresh:
        with pytest.raises(ArgumentTypeError, match="mix"):
            fresh.init([1, "a"], [f32(1), f32(1)])


@pytest.mark.parametrize("key", [1.5, None, True, b"k", np.float32(1)])
def test_bad_key_types(kv, key):
    with pytest.raises(ArgumentTypeError, match="key"):
        kv.init(key, f32(1))


@pytest.mark.parametrize("call, error", [
    (lambda kv: kv.init(1, [1.0, 2.0]), InvalidArgumentError),
    (lambda kv: kv.init(1, 1.0), ArgumentTypeError),
    (lambda kv: kv.init(1, "abc"), ArgumentTypeError),
    (lambda kv: kv.init([1, 2], [f32(1)]), InvalidArgumentError),
    (lambda kv: kv.init(1, np.array(["x"])), InvalidArgumentError),
    (lambda kv: kv.init(1, np.zeros(2, dtype=object)), InvalidArgumentError),
    (lambda kv: kv.set_optimizer("sgd"), ArgumentTypeError),
    (lambda kv: kv.pull(1), InvalidArgumentError),
    (lambda kv: kv.push(1, f32(1), priority="high"), ArgumentTypeError),
])
def test_bad_argument_types(kv, call, error):
    with pytest.raises(error):
        call(kv)


def test_closed_store_refuses_calls():
    kv = kvstore.create("local")
    kv.init(1, f32(1))
    kv.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        kv.push(1, f32(1))


def test_load_states_from_garbage_file(kv, tmp_path):
    kv.init(0, f32(2))
    kv.set_optimizer(opt.SGD(momentum=0.9))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00not msgpack at all")
    with pytest.raises(InvalidArgumentError, match="not a kvstore optimizer-state file|cannot read"):
        kv.load_optimizer_states(str(bad))

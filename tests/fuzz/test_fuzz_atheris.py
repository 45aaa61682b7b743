"""Coverage-guided fuzzing (atheris) of the pure path: ``decode`` +
``ServerState.handle``, no sockets.

With atheris installed, ``test_atheris_decode_and_state`` runs a bounded
coverage-guided fuzz in a subprocess (libFuzzer ends its process when done). Each
input delivers 1-3 messages from different peers to one fresh state (so sync
rounds can complete): decode must raise only ProtocolError, handle() must never
raise, a rejected request changes nothing, and every reply encodes. Without
atheris the test is skipped.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from fuzzing import DTYPES, EDGE_INTS, FIELDS, ROOT
from kvstore.errors import ProtocolError
from kvstore.protocol import decode, encode, ops
from kvstore.server.state import ServerState

try:  # optional: coverage-guided fuzzing of the pure path
    import atheris
except ImportError:  # pragma: no cover - depends on the environment
    atheris = None


# -- atheris: decode + ServerState.handle, no sockets -------------------------------------
A_RUNS = int(os.environ.get("KVSTORE_ATHERIS_RUNS", "8000"))
A_OPS = sorted(ops.REQUESTS) + [ops.OK, ops.ERROR, "nope"]
A_KEYS = {("a", 0): np.arange(6, dtype=np.float32), ("a", 1): np.arange(5, dtype=np.float32),
          (7, 0): np.arange(4, dtype=np.int32), (8, 0): np.ones(3, np.float16),
          (9, 0): np.zeros(0, np.float64)}


def _a_state(kind: int) -> ServerState:
    """Fresh states: sync without optimizer / sync with SGD momentum / async with Adam."""
    state = ServerState(name="fuzz")
    mode = "async" if kind == 2 else "sync"
    state.handle(b"p", {"op": "configure", "id": 1, "src": 0, "mode": mode, "num_workers": 2}, [])
    ids = list(A_KEYS)
    state.handle(b"p", {"op": "init", "id": 2, "src": 0, "chunks": [list(c) for c in ids]},
                 [a.copy() for a in A_KEYS.values()])
    if kind:
        opt = {"name": "sgd", "params": {"momentum": 0.9}} if kind == 1 else {"name": "adam"}
        state.handle(b"p", {"op": "set_optimizer", "id": 3, "src": 0, "optimizer": opt}, [])
    return state


def _a_value(fdp, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-3, 12)
    if kind == 3:
        return fdp.PickValueInList(EDGE_INTS)
    if kind == 4:
        return fdp.ConsumeFloat()
    if kind == 5:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8))
    if kind == 6:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
    n = fdp.ConsumeIntInRange(0, 4)
    if kind in (7, 8):
        return [_a_value(fdp, depth + 1) for _ in range(n)]
    return {fdp.PickValueInList(FIELDS + ["type", "name", "params"]): _a_value(fdp, depth + 1)
            for _ in range(n)}


def _a_message(fdp) -> list:
    mode = fdp.ConsumeIntInRange(0, 4)
    if mode == 0:   # raw frames
        return [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) for _ in range(fdp.ConsumeIntInRange(1, 3))]
    if mode == 1:   # any msgpack value as the header
        return [msgpack.packb(_a_value(fdp), use_bin_type=True)]
    op = fdp.PickValueInList(A_OPS)
    header = {"v": fdp.PickValueInList([1, 1, 1, 0, 2, True, "1"]), "op": op,
              "id": fdp.PickValueInList([1, 0, -1, 2 ** 64 - 1, True, None, "1", 1.0]),
              "src": fdp.PickValueInList([0, 1, 1, 0, 2, -1, True, None, "0", 2 ** 63 - 1])}
    cids, datas, bufs = [], [], []
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        pick = fdp.ConsumeIntInRange(0, 6)
        if pick <= 4:
            cid = list(fdp.PickValueInList(list(A_KEYS)))
        elif pick == 5:
            cid = [_a_value(fdp, 2), fdp.ConsumeIntInRange(-1, 3)]
        else:
            cid = _a_value(fdp, 1)
        cids.append(cid)
        try:
            ref = A_KEYS.get(tuple(cid)) if isinstance(cid, list) and len(cid) == 2 else None
        except TypeError:  # unhashable key
            ref = None
        dtype = ref.dtype.str if ref is not None and fdp.ConsumeProbability() < 0.8 \
            else fdp.PickValueInList(DTYPES)
        shape = [ref.size] if ref is not None and fdp.ConsumeProbability() < 0.8 else \
            [fdp.PickValueInList([0, 1, 2, 3, 4, 5, 6, 2 ** 39, 2 ** 40, -1]) for _ in
             range(fdp.ConsumeIntInRange(0, 3))]
        bufs.append([dtype, shape])
        try:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        except Exception:  # not a dtype numpy knows
            nbytes = 0
        datas.append(fdp.ConsumeBytes(nbytes if 0 <= nbytes <= 64 and fdp.ConsumeProbability() < 0.9
                                      else fdp.ConsumeIntInRange(0, 16)))
    if fdp.ConsumeBool():
        header["chunks"] = cids
    if op in (ops.PUSH, ops.PUSHPULL) and fdp.ConsumeBool():
        header["compression"] = {"type": fdp.PickValueInList(["2bit", "1bit", "fp16", "none", "x"]),
                                 "threshold": fdp.PickValueInList([0.5, 0, -1, 1e300, 2, True])}
    if op == ops.SET_OPTIMIZER:
        header["optimizer"] = fdp.PickValueInList([
            {"name": "sgd"}, {"name": "adam", "params": {"beta1": 0.5}}, {"name": "nope"},
            {"name": "sgd", "lr_scheduler": {"name": "factor", "params": {"step": 2}}}]) \
            if fdp.ConsumeBool() else _a_value(fdp)
    if op in (ops.SET_STATES, ops.GET_STATES):
        header["states"] = [[c[0] if isinstance(c, list) and c else c, fdp.ConsumeIntInRange(-1, 2),
                             fdp.PickValueInList([0, 1, 5, 2 ** 64 - 1]), fdp.ConsumeIntInRange(0, 3)]
                            for c in cids] if fdp.ConsumeBool() else _a_value(fdp)
    if op == ops.CONFIGURE:
        header["mode"] = fdp.PickValueInList(["sync", "async", None])
        header["num_workers"] = fdp.PickValueInList([2, 1, 0, -1, True, 2 ** 64 - 1])
    for _ in range(fdp.ConsumeIntInRange(0, 2) if fdp.ConsumeProbability() < 0.3 else 0):
        header[fdp.PickValueInList(FIELDS)] = _a_value(fdp)
    header.setdefault("bufs", bufs)
    frames = [msgpack.packb(header, use_bin_type=True), *datas]
    if mode == 4 and fdp.remaining_bytes():   # byte-level damage to the header
        head = frames[0]
        i = fdp.ConsumeIntInRange(0, len(head) - 1)
        frames[0] = head[:i] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 3)) + head[i + 1:]
    return frames


def atheris_one_input(data: bytes) -> None:
    """One atheris input: 1-3 messages from different peers to one fresh state (so
    sync rounds can complete). decode must raise only ProtocolError; handle() must
    never raise; a rejected request changes nothing; every reply encodes."""
    fdp = atheris.FuzzedDataProvider(data)
    state = _a_state(fdp.ConsumeIntInRange(0, 2))
    for n in range(fdp.ConsumeIntInRange(1, 3)):
        _a_deliver(state, b"peer%d" % n, _a_message(fdp))


def _a_deliver(state: ServerState, peer: bytes, frames: list) -> None:
    try:
        header, arrays = decode(frames, 1 << 20)
    except ProtocolError:
        return
    if not isinstance(header.get("src"), int) or not isinstance(header.get("id"), int):
        return   # ServerNode answers these before the state machine sees them
    before = {cid: c.value.copy() for cid, c in state.chunks.items()}
    replies = state.handle(peer, header, arrays)
    for reply in replies:
        assert reply.header["op"] in (ops.OK, ops.ERROR), reply.header
        encode(reply.header, reply.arrays)
    if len(replies) == 1 and replies[0].peer == peer and replies[0].header["op"] == ops.ERROR:
        assert set(state.chunks) == set(before), "a rejected request created chunks"
        for cid, value in before.items():
            assert np.array_equal(state.chunks[cid].value, value, equal_nan=True), \
                f"a rejected request changed {cid}"


ATHERIS_MAIN = """
import sys
import warnings
import atheris
warnings.simplefilter("ignore")   # numpy overflow warnings of fuzzed float16 values
with atheris.instrument_imports(include=["kvstore"]):
    import kvstore.protocol.codec, kvstore.server.state, kvstore.compression, kvstore.optimizer
sys.path[:0] = {paths!r}   # this test's folder and tests/ (fuzzing.py)
import test_fuzz_atheris
atheris.Setup(sys.argv, test_fuzz_atheris.atheris_one_input)
atheris.Fuzz()
"""


@pytest.mark.skipif(atheris is None, reason="atheris is not installed (pip install atheris)")
def test_atheris_decode_and_state(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    code = ATHERIS_MAIN.format(paths=[here, os.path.dirname(here)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", code, f"-runs={A_RUNS}", "-seed=20240607", "-max_total_time=40",
         "-max_len=1024", "-len_control=0", "-rss_limit_mb=2048",
         f"-artifact_prefix={tmp_path}{os.sep}", "-print_final_stats=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"Done {A_RUNS} runs" in out or "stat::number_of_executed_units" in out, out[-3000:]

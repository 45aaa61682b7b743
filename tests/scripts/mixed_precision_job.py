"""A dist job of mixed precision on the wire (kvstore.precision), run by
tests/api/test_multi_precision.py under ``python -m tracker.local -n 2 -s 2``.

Every worker pushes the same random float16 and bfloat16 gradients to float32 keys
(multi-precision on) and, upcast to float32, to twin float32 keys; the values
pulled back must be the twins' bit for bit (float32 outputs), and their rounding
once (float16/bfloat16 outputs), with and without an optimizer. It prints one line
per check, ``RANK <rank> <check> <result>``, and the bytes each push sent.

    python -m tracker.local -n 2 -s 2 python tests/scripts/mixed_precision_job.py [deterministic]
"""

import sys

import torch

import kvstore
from kvstore import optimizer as opt
from kvstore.errors import InvalidArgumentError

deterministic = "deterministic" in sys.argv[1:]
kv = kvstore.create("dist_sync", deterministic=deterministic)
rank = kv.rank
SIZES = {"a": 1000, "b": 40_000}          # "b" is cut into chunks over both servers (64 KiB chunks)
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def say(check, result):
    print(f"RANK {rank} {check} {result}", flush=True)


def grads(step, dtype):
    """This worker's gradients of a step, in ``dtype`` (float16 values within range)."""
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + (dtype == torch.float16))
    return {k: (torch.randn(n, generator=g) * 3).to(dtype) for k, n in SIZES.items()}


def sent():
    return kv.comm_stats()["bytes_sent"]


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


start = torch.Generator().manual_seed(5)
w0 = {k: torch.randn(n, generator=start) for k, n in SIZES.items()}
for name in LOW:
    kv.init([f"{name}-{k}" for k in SIZES], [w0[k].clone() for k in SIZES])      # float32 keys
    kv.init([f"{name}-twin-{k}" for k in SIZES], [w0[k].clone() for k in SIZES])

# -- without the opt-in: refused before anything is sent -----------------------------------
before = sent()
for name, dtype in LOW.items():
    try:
        kv.push(f"{name}-a", torch.zeros(SIZES["a"], dtype=dtype))
        say(f"refused-off-{name}", "NOT-REFUSED")
    except InvalidArgumentError as e:
        say(f"refused-off-{name}", "set_multi_precision" in str(e))
say("refused-off-sent", sent() == before)
kv.set_multi_precision(True)


def exchange(step, with_optimizer):
    """One step of pushes (and pulls) of both precisions; the checks of its results."""
    for name, dtype in LOW.items():
        g = grads(step, dtype)
        keys, twins = [f"{name}-{k}" for k in SIZES], [f"{name}-twin-{k}" for k in SIZES]
        low = [g[k] for k in SIZES]
        wide = [g[k].float() for k in SIZES]
        b0 = sent()
        if step % 2 == 0:            # push + pull
            kv.push(keys, low)
            b1 = sent()
            kv.push(twins, wide)
            b2 = sent()
        else:                        # pushpull, into outputs of the gradients' dtype
            outs_low = [torch.empty(n, dtype=dtype) for n in SIZES.values()]
            twin_outs = [torch.empty(n) for n in SIZES.values()]
            kv.pushpull(keys, low, out=outs_low)
            b1 = sent()
            kv.pushpull(twins, wide, out=twin_outs)
            b2 = sent()
            say(f"pushpull-{name}-rounded-once-{step}",
                all(bits(o) == bits(t.to(dtype)) for o, t in zip(outs_low, twin_outs)))
        masters = [torch.empty(n) for n in SIZES.values()]
        lows = [torch.empty(n, dtype=dtype) for n in SIZES.values()]
        twin_masters = [torch.empty(n) for n in SIZES.values()]
        kv.pull(keys, out=masters)
        kv.pull(keys, out=lows)
        kv.pull(twins, out=twin_masters)
        say(f"float32-bits-{name}-{step}-{with_optimizer}",
            all(bits(m) == bits(t) for m, t in zip(masters, twin_masters)))
        say(f"rounded-once-{name}-{step}-{with_optimizer}",
            all(bits(lo) == bits(t.to(dtype)) for lo, t in zip(lows, twin_masters)))
        changed = not all(torch.equal(m, w0[k]) for m, k in zip(masters, SIZES))
        say(f"changed-{name}-{step}", changed)
        print(f"BYTES {rank} {name} {step} {b1 - b0} {b2 - b1}", flush=True)


for step in range(2):
    exchange(step, False)
kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4, rescale_grad=0.5))
for step in range(2, 5):
    exchange(step, True)

# -- every other check stays, with the opt-in -------------------------------------------------
before = sent()
refusals = {
    "shape": lambda: kv.push("bf16-a", torch.zeros(SIZES["a"] + 1, dtype=torch.bfloat16)),
    "float64": lambda: kv.push("bf16-a", torch.zeros(SIZES["a"], dtype=torch.float64)),
    "int8": lambda: kv.push("bf16-a", torch.zeros(SIZES["a"], dtype=torch.int8)),
    "shape-out": lambda: kv.pull("bf16-a", out=torch.zeros(SIZES["a"] + 1, dtype=torch.bfloat16)),
}
for check, call in refusals.items():
    try:
        call()
        say(f"refused-{check}", "NOT-REFUSED")
    except InvalidArgumentError:
        say(f"refused-{check}", True)
kv.set_multi_precision(False)          # plans made under the opt-in are forgotten
try:
    kv.push(["bf16-a", "bf16-b"], [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES.values()])
    say("refused-after-off", "NOT-REFUSED")
except InvalidArgumentError:
    say("refused-after-off", True)
say("refused-sent", sent() == before)
kv.barrier()
kv.close()

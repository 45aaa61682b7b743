"""A Ray actor parameter server, as in Ray's documentation ("Parameter Server"
example: a ``@ray.remote`` ParameterServer actor whose ``apply_gradients(*grads)``
sums the workers' gradients and returns the weights; worker actors hand in
gradients and take the weights). Runs in benchmarks/.venv-ray; started by
benchmarks/harness/peers/ray_peer.py. Prints nothing but errors; writes JSON to --out.

One exchange (timed, driven from the driver as in the docs' synchronous loop):
every worker returns its gradient list (into Ray's shared-memory object store),
the server sums them (zero-copy reads) and returns the new weights, and every
worker copies the weights into its own parameter buffers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.resnet50_shapes import model_shapes  # noqa: E402


@ray.remote
class ParameterServer:
    def __init__(self, shapes):
        self.params = [np.zeros(s, np.float32) for s in shapes]

    def apply_gradients(self, *gradients):
        # sum over workers, assigned as the new value (as our store without optimizer)
        for k, p in enumerate(self.params):
            np.copyto(p, gradients[0][k])
            for g in gradients[1:]:
                p += g[k]
        return self.params

    def ping(self):
        return 1


@ray.remote
class Worker:
    def __init__(self, rank, num_workers, shapes):
        self.rank, self.num_workers = rank, num_workers
        self.grads = [np.zeros(s, np.float32) for s in shapes]
        self.weights = [np.zeros(s, np.float32) for s in shapes]

    def prepare(self, it):  # untimed: "compute" this iteration's gradients
        common.fill_grads(self.grads, self.rank, it)
        for wt in self.weights:
            wt.fill(-1.0)
        return 1

    def compute_gradients(self):
        return self.grads

    def set_weights(self, weights):
        for dst, src in zip(self.weights, weights):
            np.copyto(dst, src)
        return 1

    def check(self, it):
        common.verify(self.weights, self.num_workers, it, f"ray worker {self.rank}")
        return 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--latency-sizes", default="1,1024,16384")
    p.add_argument("--latency-iters", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    w = args.workers
    shapes = model_shapes(args.model)
    ray.init(num_cpus=w + 1, include_dashboard=False, log_to_driver=True,
             configure_logging=False, _temp_dir=os.environ.get("BENCH_RAY_TMP"))
    try:
        # the type: ignores: @ray.remote gives the classes .remote, a class decorator mypy does not apply
        ps = ParameterServer.remote(shapes)  # type: ignore[attr-defined]
        workers = [Worker.remote(r, w, shapes) for r in range(w)]  # type: ignore[attr-defined]
        ray.get([ps.ping.remote()] + [x.prepare.remote(0) for x in workers])

        def prepare(i):
            ray.get([x.prepare.remote(i) for x in workers])

        def step(i):
            weights = ps.apply_gradients.remote(*[x.compute_gradients.remote() for x in workers])
            ray.get([x.set_weights.remote(weights) for x in workers])

        def check(i):
            ray.get([x.check.remote(i) for x in workers])
        times, per = common.timed_loop(step, prepare, check, args.iters, args.warmup)
        result = {"modes": {"actor_ps": {"times": times, **per}}, "num_workers": w,
                  "ray_version": ray.__version__, "numpy_version": np.__version__}
        if args.latency_iters:
            result["latency"] = {}
            for n in (int(x) for x in args.latency_sizes.split(",")):
                lps = ParameterServer.remote([(n,)])  # type: ignore[attr-defined]
                lws = [Worker.remote(r, w, [(n,)]) for r in range(w)]  # type: ignore[attr-defined]
                times = []
                for i in range(args.latency_iters + 20):
                    ray.get([x.prepare.remote(i) for x in lws])
                    t0 = time.perf_counter()
                    weights = lps.apply_gradients.remote(*[x.compute_gradients.remote() for x in lws])
                    ray.get([x.set_weights.remote(weights) for x in lws])
                    t1 = time.perf_counter()
                    ray.get([x.check.remote(i) for x in lws])
                    if i >= 20:
                        times.append(t1 - t0)
                result["latency"][str(n * 4)] = times
                for a in [lps, *lws]:
                    ray.kill(a)
        common.write_json(args.out, result)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

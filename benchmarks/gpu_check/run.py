"""One command that proves the GPU path on a machine with an NVIDIA GPU.

    python -m benchmarks.gpu_check                 # everything, ~6 minutes on one H100
    python -m benchmarks.gpu_check --budget 420    # within 7 minutes: GPU tests first, then what fits
    python -m benchmarks.gpu_check --only aggregation,exchange

Sections (each is skipped with its reason where it cannot run, never faked):

1. ``pytest``: ``pytest -m gpu -rs``; the summary line and every skip reason.
2. ``aggregation``: the GPU server's own code path (ServerState on a GpuBackend:
   the merge of W=2 pushes and the optimizer update, chunk by chunk as the server
   runs them) in GB/s, against a device-to-device copy measured in the same run.
   Bytes counted are the least any implementation must move: every gradient read
   once, the weight and each optimizer state read and written once (a copy counts
   its read and its write).
3. ``phases``: the steps of one such exchange, each timed alone on the GPU
   (benchmarks/gpu_check/phases.py): over cuda_ipc (161 keys and 19 flat buckets:
   the worker's staging, the server's round, the reply's copies) and over shared
   memory (packing, every host copy).
4. ``ipc``: two processes sharing device memory through CUDA IPC (memory and
   event handles), device-to-device against through the host (benchmarks/gpu_check/ipc.py).
5. ``exchange``: one ResNet-50 gradient exchange (102.2 MB of CUDA tensors), W=2
   workers sharing the GPU: ours (``dist_device_sync``, 2 GPU servers, 161 keys, the
   Trainer's 19 flat buckets or one key; and 2 CPU servers) against gloo all_reduce
   of the same CUDA tensors.
6. ``train``: a ResNet-50 training step (batch 32 per worker, synthetic), W=2:
   ``kvstore.torch.Trainer`` with GPU servers against DDP over gloo.
7. ``cifar``: ``examples/train_cifar10.py --benchmark 1 --gpus 0 --kvstore
   dist_device_sync`` with GPU servers for one epoch (195 batches per worker).

Writes ``gpu_check.md`` and ``.json`` to --out-dir (default: a new scratch directory;
``--record``: benchmarks/results/gpu) with the GPU's name,
driver, torch and cupy versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

from benchmarks.gpu_check import ipc as gpu_ipc, phases as gpu_phases
from benchmarks.harness.output import ResultsDir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("gpu-check", "gpu")
SECTIONS = ("pytest", "aggregation", "phases", "ipc", "exchange", "train", "cifar")
# seconds each section took on an H100 (2026-11-24 to -28: pytest 73-94, aggregation 0-1,
# phases 1-2, ipc 6-7, exchange 23-34, train 29-42 with two contenders, cifar 17-22), plus a
# margin (train: a third contender since 2026-11-28, exchange a fourth and a fifth): a section starts only if this much of
# the budget is left (--budget)
EXPECTED = {"pytest": 150, "aggregation": 40, "phases": 25, "ipc": 20, "exchange": 90, "train": 150, "cifar": 120}


def run_sections(steps: dict, order: list, budget: float | None, save, clock=time.monotonic,
                 expected: dict = EXPECTED) -> dict:
    """Run ``steps[name](seconds_left)`` for each section in ``order``, isolated: a
    section that raises is recorded (its error and traceback) and the next one runs;
    with a ``budget`` (seconds), a section whose expected time no longer fits is
    skipped with the reason. ``save(results)`` after each, so a loan that ends early
    keeps what was measured. Returns {section: result | {"error"} | {"skipped"}}."""
    import traceback
    results: dict = {}
    start = clock()
    for name in order:
        left = None if budget is None else budget - (clock() - start)
        need = expected.get(name, 60)
        if left is not None and left < need:
            results[name] = {"skipped": f"budget: {left:.0f} s left of {budget:.0f} s, {name} needs about {need} s"}
            save(results)
            continue
        t0 = clock()
        print(f"== {name}" + ("" if left is None else f" ({left:.0f} s of the budget left)"), flush=True)
        try:
            results[name] = steps[name](left)
        except Exception as e:    # one section's failure must not cost the others their measurement
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(results[name], indent=1, default=str)[:4000], f"({clock() - t0:.0f} s)", flush=True)
        save(results)
    return results


def env_of_job() -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def info(commit: str | None) -> dict:
    import cupy
    import numpy
    import torch
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return {"gpu": props["name"].decode(), "gpus": cupy.cuda.runtime.getDeviceCount(),
            "driver": cupy.cuda.runtime.driverGetVersion(), "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cupy": cupy.__version__,
            "numpy": numpy.__version__, "python": sys.version.split()[0], "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                               capture_output=True, text=True).stdout.strip() or "unknown"}


def run_pytest(timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider"]
    p = subprocess.run(cmd, cwd=ROOT, env=env_of_job(), capture_output=True, text=True, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed)", ln)), "no summary")
    return {"returncode": p.returncode, "summary": summary.strip("= "),
            "skipped": [ln for ln in lines if ln.startswith("SKIPPED")],
            "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))],
            "tail": "\n".join(lines[-60:]) if p.returncode else ""}


def server_rounds(backend, xp, n: int, count: int, workers: int, optimizer, batched: bool = False):
    """A server state on ``backend`` with ``count`` chunks of ``n`` float32 values
    (configured for ``workers``, ``optimizer`` set) and a function that runs one
    sync round on every chunk exactly as the server does once pushes are uploaded:
    each worker's gradient (``xp`` arrays, worker w's all ``0.5 * (w + 1)``) is
    contributed, then the complete rounds are applied. ``batched``: as Sync.join
    runs a push, each worker's push of every chunk one event, whose updates a GPU
    server runs in one multi-tensor launch (kvstore/optimizer/multi_tensor.py);
    otherwise chunk by chunk, one fused kernel each. CI runs it on the host
    backend with numpy (tests/benchmarks/test_gpu_check.py); the GPU run times it on CuPy."""
    import numpy as np
    from kvstore.server.state import ServerState
    from typing import cast

    from kvstore.modes import SYNC
    from kvstore.server.sync import Sync
    state = ServerState(name="bench", backend=backend)
    state.handle(b"w", {"op": "configure", "id": 1, "src": 0, "mode": "sync", "num_workers": workers}, [])
    ids = [["k", i] for i in range(count)]
    state.handle(b"w", {"op": "init", "id": 2, "src": 0, "chunks": ids}, [np.zeros(n, np.float32) for _ in ids])
    if optimizer is not None:
        state.handle(b"w", {"op": "set_optimizer", "id": 3, "src": 0, "optimizer": optimizer.to_config()}, [])
    with backend.scope():
        grads = [xp.full(n, 0.5 * (w + 1), xp.float32) for w in range(workers)]
    chunks = [(("k", i), state.chunks[("k", i)]) for i in range(count)]
    assert state.consistency is not None and state.consistency.mode is SYNC    # configured "sync" above
    sync = cast(Sync, state.consistency)     # (the sync mode's rounds: contribute, apply_complete)

    def one_round() -> None:
        if batched:
            for w in range(workers):
                with backend.batched():         # one push: the last one completes every chunk
                    for cid, chunk in chunks:
                        sync.contribute(cid, chunk, frozenset({w}), grads[w])
                        sync.apply_complete(cid, chunk)
            return
        for cid, chunk in chunks:
            for w in range(workers):
                sync.contribute(cid, chunk, frozenset({w}), grads[w])
            sync.apply_complete(cid, chunk)
    return state, one_round


def aggregation(total_mb: int = 64, chunk_mbs=(2, 16, 64), workers: int = 2, reps: int = 20) -> dict:
    import cupy
    from kvstore import optimizer as opt
    from kvstore.server.backend import GpuBackend
    backend = GpuBackend(0)

    def gpu_ms(fn) -> float:
        with backend.scope():
            for _ in range(3):                     # warm-up: kernels compiled, pools filled
                fn()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return cupy.cuda.get_elapsed_time(start, end) / reps

    rows = []
    n_total = (total_mb << 20) // 4
    src, dst = (cupy.ones(n_total, cupy.float32) for _ in range(2))
    copy_ms = gpu_ms(lambda: cupy.copyto(dst, src))
    copy_gbs = 2 * n_total * 4 / copy_ms / 1e6
    for chunk_mb in chunk_mbs:
        n = (chunk_mb << 20) // 4
        count = total_mb // chunk_mb
        # the updates per chunk (one fused kernel each), then (issue 45 item 2) each push's
        # updates in one multi-tensor launch, as GPU servers run them now
        for name, optimizer, batched in (("sum", None, False),
                                         ("sgd momentum", opt.SGD(learning_rate=0.1, momentum=0.9), False),
                                         ("adam", opt.Adam(learning_rate=0.001), False),
                                         ("sgd momentum, multi-tensor", opt.SGD(learning_rate=0.1, momentum=0.9), True),
                                         ("adam, multi-tensor", opt.Adam(learning_rate=0.001), True)):
            _, one_round = server_rounds(backend, cupy, n, count, workers, optimizer, batched)
            ms = gpu_ms(one_round)
            states = 0 if optimizer is None else optimizer.num_states
            least = n_total * 4 * (workers + 2 * (1 + states) - (1 if optimizer is None else 0))
            gbs = least / ms / 1e6
            rows.append({"chunk_mb": chunk_mb, "update": name, "ms": round(ms, 3), "gb_s": round(gbs, 1),
                         "vs_copy": round(gbs / copy_gbs, 3)})
    return {"total_mb": total_mb, "workers": workers, "copy_ms": round(copy_ms, 3),
            "copy_gb_s": round(copy_gbs, 1), "rows": rows}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(task: str, contender: str, out: str, timeout: float, extra=()) -> dict:
    """Run one timed job (2 workers); the JSON its rank 0 wrote, or the failure."""
    worker = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check", "worker.py"), task, "--out", out, *extra]
    env = env_of_job()
    t0 = time.time()
    if contender == "gloo":
        port = free_port()
        procs = [subprocess.Popen([*worker, "--gloo"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env={**env, "RANK": str(r), "WORLD_SIZE": "2",
                                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
                 for r in range(2)]
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        code, text = max(p.returncode for p in procs), "\n".join(outputs)
    else:
        device = "gpu" if contender.startswith("ours gpu servers") else "cpu"
        if contender.endswith("flat buckets"):
            worker += ["--flat-buckets"] if task == "train" else ["--layout", "buckets"]
        elif contender.endswith("one key"):
            worker += ["--layout", "flat"]
        p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", "--server-device",
                            device, *worker], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, text = p.returncode, p.stdout + p.stderr
    if code != 0 or not os.path.exists(out):
        return {"contender": contender, "failed": f"exit {code}", "tail": text[-3000:]}
    with open(out) as f:
        result = json.load(f)
    return {"contender": contender, "median_ms": round(result["median_ms"], 1),
            "samples": len(result["samples_ms"]), "wall_s": round(time.time() - t0, 1),
            "transports": ",".join(result.get("transports") or []) or "-"}


def cifar(timeout: float) -> dict:
    cmd = [sys.executable, "-m", "tracker.local", "-n", "2", "-s", "2", "--server-device", "gpu",
           sys.executable, "examples/train_cifar10.py", "--benchmark", "1", "--gpus", "0",
           "--kvstore", "dist_device_sync", "--num-epochs", "1", "--disp-batches", "50"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env_of_job(), capture_output=True, text=True, timeout=timeout)
    text = p.stdout + p.stderr
    speeds = [float(s) for s in re.findall(r"\[worker:0\].*Speed: ([\d.]+) samples/sec", text)]
    batches = re.findall(r"\[worker:0\].*Batch \[(\d+)\]", text)
    return {"command": " ".join(cmd[1:]).replace(sys.executable, "python"), "returncode": p.returncode,
            "wall_s": round(time.time() - t0, 1), "last_batch_logged": int(batches[-1]) if batches else 0,
            "speeds_samples_per_s": speeds,
            "validation": re.findall(r"\[worker:0\].*(Validation-accuracy=[\d.]+)", text),
            "tail": "" if p.returncode == 0 else text[-3000:]}


def report(results: dict) -> str:
    i = results["info"]
    lines = [f"# GPU check: {i['gpu']} ({i['when']}, kvstore {i['commit']})", "",
             f"driver {i['driver']}, CUDA runtime {i['cuda_runtime']}, torch {i['torch']} (CUDA {i['torch_cuda']}), "
             f"cupy {i['cupy']}, numpy {i['numpy']}, Python {i['python']}; {i['gpus']} GPU(s).", ""]
    results = dict(results)
    for section in SECTIONS:     # a section that failed or did not fit: say so, and no table
        r = results.get(section)
        # a section's own "skipped" is its reason (a string); pytest's is the list of skipped tests
        if isinstance(r, dict) and ("error" in r or isinstance(r.get("skipped"), str)):
            lines += [f"## {section}: " + (f"failed: {r['error']}" if "error" in r else f"skipped ({r['skipped']})"), ""]
            if "traceback" in r:
                lines += ["```", r["traceback"].rstrip(), "```", ""]
            del results[section]
    if "pytest" in results:
        r = results["pytest"]
        lines += ["## pytest -m gpu -rs", "", f"`{r['summary']}` (exit {r['returncode']})", ""]
        lines += [f"- {ln}" for ln in r["skipped"] + r["failures"]] + [""]
    if "aggregation" in results:
        a = results["aggregation"]
        lines += ["## Server aggregation + update (ServerState on a GpuBackend, W=2)", "",
                  f"{a['total_mb']} MB of fp32 per round; device-to-device copy of the same bytes: "
                  f"{a['copy_ms']} ms = {a['copy_gb_s']} GB/s (read + write).", "",
                  "| chunk MB | update | ms per round | GB/s (least bytes) | vs copy |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['chunk_mb']} | {r['update']} | {r['ms']} | {r['gb_s']} | {r['vs_copy']:.2f} |"
                  for r in a["rows"]] + [""]
        lines += ["Targets (issue 45): the multi-tensor update at 2 MB chunks >= 0.5x of the copy, "
                  "at 64 MB >= 0.7x.", ""]
    if "phases" in results:
        lines += ["## Where a ResNet-50 exchange's time goes (benchmarks/gpu_check/phases.py)", ""]
        lines += gpu_phases.report(results["phases"])
    if "ipc" in results:
        lines += ["## CUDA IPC between two processes on one GPU (benchmarks/gpu_check/ipc.py)", ""]
        lines += gpu_ipc.report(results["ipc"])
    for section, title in (("exchange", "ResNet-50 gradient exchange, CUDA tensors, W=2 on one GPU"),
                           ("train", "ResNet-50 training step, batch 32 per worker, W=2 on one GPU")):
        if section in results:
            rows = results[section]
            base = next((r.get("median_ms") for r in rows if r["contender"] == "gloo"), None)
            lines += [f"## {title}", "", "| contender | transports | median ms | vs gloo |",
                      "|---|---|---:|---:|"]
            for r in rows:
                if "median_ms" in r:
                    ratio = f"{r['median_ms'] / base:.2f}x" if base else ""
                    lines.append(f"| {r['contender']} | {r.get('transports', '-')} | {r['median_ms']} | {ratio} |")
                else:
                    lines.append(f"| {r['contender']} | | failed: {r['failed']} | |")
            lines.append("")
    if "cifar" in results:
        c = results["cifar"]
        lines += ["## train_cifar10.py on the GPU", "", f"`{c['command']}`: exit {c['returncode']}, "
                  f"{c['wall_s']} s, last batch logged {c['last_batch_logged']}, worker 0 speeds "
                  f"{c['speeds_samples_per_s']} samples/s, {', '.join(c['validation'])}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    OUTPUT.add_arguments(p)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="finish within SECONDS: the GPU tests first, then the measurement sections that "
                        "still fit (each isolated: a failure is recorded and the next one runs)")
    p.add_argument("--commit", default=None, help="the commit measured, where the tree has no git metadata "
                                                  "of its own (a copy sent to a GPU machine)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}")
    out_dir = OUTPUT.chosen(p, args)
    from kvstore.devices import gpu
    from kvstore.devices.cuda import CudaAccelerators, CudaDevice
    if not gpu.available():
        print(f"gpu_check needs a usable NVIDIA GPU with CuPy: {gpu.reason()}", file=sys.stderr)
        return 2
    results = {"info": info(args.commit)}
    tmp = os.path.join(out_dir, ".tmp")
    os.makedirs(tmp, exist_ok=True)

    def save():
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
            f.write(report(results))

    def until(left):             # the section's deadline (monotonic), None without a budget
        return None if left is None else time.monotonic() + left

    def within(seconds, deadline):   # one job's timeout: never past the section's deadline
        return seconds if deadline is None else max(30, min(seconds, deadline - time.monotonic()))

    def jobs(task, contenders, seconds, left):
        deadline = until(left)
        return [job(task, c, os.path.join(tmp, f"{task[0]}{i}.json"), within(seconds, deadline),
                    ("--iters", str(args.iters))) for i, c in enumerate(contenders)]

    steps = {
        "pytest": lambda left: run_pytest(timeout=within(300, until(left))),
        "aggregation": lambda left: aggregation(),
        "phases": lambda left: gpu_phases.phases(CudaDevice(0), CudaAccelerators()),
        "ipc": lambda left: gpu_ipc.ipc(env=env_of_job(), timeout=within(120, until(left))),
        "exchange": lambda left: jobs("exchange", ("gloo", "ours gpu servers", "ours gpu servers, flat buckets",
                                                   "ours gpu servers, one key", "ours cpu servers"), 180, left),
        "train": lambda left: jobs("train", ("gloo", "ours gpu servers", "ours gpu servers, flat buckets"), 240,
                                   left),
        "cifar": lambda left: cifar(timeout=within(300, until(left))),
    }

    def save_all(sections):
        results.update(sections)
        save()
    run_sections(steps, only, args.budget, save_all)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

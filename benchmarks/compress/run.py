"""Gradient compression in one process: what compressing and decompressing cost.

    python -m benchmarks.compress                  # ResNet-50's 25.6M fp32 values
    python -m benchmarks.compress --before 334c303 # also that commit's compression.py

Real gradients have random signs, so the values are normal random numbers (scaled
so that 2bit at threshold 0.5 sends about a third of them); a benchmark that
pushes constants (as ``benchmarks.pushpull`` must, to know the exact sum) hides
the cost of data-dependent branches. Each type runs compress (the residual
carried from call to call, as a worker does) and decompress (as a server does),
medians over ``--repeats``; the ceiling is numpy copying the same fp32 bytes.
Every result is checked: decompress(compress(g)) plus the new residual must give
back g plus the old residual (to rounding), and with ``--before`` both versions
must produce the same bytes, residuals and values bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import click
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.harness.resnet50_shapes import RESNET50_VALUES  # noqa: E402
from kvstore import compression  # noqa: E402

KINDS = {"2bit": 0.5, "1bit": 0.0, "fp16": 0.0}


def _module_at(ref: str):
    """``kvstore/compression.py`` as of git ``ref``, imported next to today's."""
    source = subprocess.run(["git", "show", f"{ref}:kvstore/compression.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="compress-before-"), "compression.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("kvstore._compression_before", path)
    assert spec is not None and spec.loader is not None   # a .py file: a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)     # its relative imports resolve in kvstore
    return module


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def measure(module, kind: str, grad: np.ndarray, repeats: int) -> dict:
    config = module.validate({"type": kind, "threshold": KINDS[kind]})
    residual = None if kind == "fp16" else np.zeros_like(grad)
    before = None if residual is None else residual.copy()
    payload = module.compress(config, grad, residual)
    values = module.decompress(config, payload, grad.size, grad.dtype)
    want = grad if residual is None else grad + before
    got = values if residual is None else values + residual
    tolerance = 1e-3 if kind == "fp16" else 1e-6     # fp16 rounds; the others carry the rest
    if not np.allclose(got, want, rtol=tolerance, atol=tolerance):
        raise click.ClickException(f"{kind}: sent values plus residual differ from the gradient")
    return {"payload": payload, "residual": residual, "values": values,
            "compress_ms": _median_ms(lambda: module.compress(config, grad, residual), repeats),
            "decompress_ms": _median_ms(lambda: module.decompress(config, payload, grad.size, grad.dtype),
                                        repeats)}


def _same(a: dict, b: dict, kind: str) -> None:
    for name in ("payload", "residual", "values"):
        if a[name] is not None and not np.array_equal(a[name], b[name], equal_nan=True):
            raise click.ClickException(f"{kind}: the {name} differs from the --before version's")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--size", type=click.IntRange(min=1), default=RESNET50_VALUES, show_default=True,
              help="fp32 values (default: ResNet-50's parameter count).")
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--before", metavar="GIT_REF", help="Also time this commit's kvstore/compression.py.")
def main(size, repeats, before):
    grad = (np.random.default_rng(0).standard_normal(size) * 0.5).astype(np.float32)
    versions = [("today", compression)] + ([(before, _module_at(before))] if before else [])
    copy = np.empty_like(grad)
    ceiling = _median_ms(lambda: np.copyto(copy, grad), repeats)
    print(f"{size:,} fp32 values ({grad.nbytes / 1e6:.1f} MB), median of {repeats}; "
          f"numpy copy of the same bytes: {ceiling:.1f} ms; torch imported: {'torch' in sys.modules}")
    print("| type | code | compress ms | decompress ms | payload MB | compress vs copy |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in KINDS:
        results = [(name, measure(module, kind, grad, repeats)) for name, module in versions]
        for name, r in results:
            print(f"| {kind} | {name} | {r['compress_ms']:.1f} | {r['decompress_ms']:.1f} | "
                  f"{r['payload'].nbytes / 1e6:.1f} | {r['compress_ms'] / ceiling:.1f}x |")
        if len(results) == 2:
            # same start (zero residual) and same gradient: the first call's outputs must agree
            _same(*[measure(module, kind, grad, 1) for _, module in versions], kind)


if __name__ == "__main__":
    main()

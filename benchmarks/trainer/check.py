"""The correctness check of benchmarks.trainer: every worker's parameters after its
steps against the single-process references (and ours against DDP of the same
round), and the per-contender verdict the report shows."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.trainer.contenders import CONTENDERS


def compare(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> dict:
    """How far ``got`` is from ``want`` (flat float32 parameters): ok is
    ``numpy.allclose(got, want, rtol, atol)`` with matching shapes and finite values."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return {"ok": False, "why": f"shape {got.shape} != {want.shape}"}
    if not np.all(np.isfinite(got)):
        return {"ok": False, "why": "non-finite parameters"}
    diff = np.abs(got - want)
    excess = diff - (atol + rtol * np.abs(want))
    worst = int(np.argmax(excess)) if diff.size else 0
    return {"ok": bool(diff.size == 0 or excess[worst] <= 0), "max_abs": float(diff.max(initial=0.0)),
            "max_rel": float((diff / np.maximum(np.abs(want), 1e-12)).max(initial=0.0)),
            "worst_index": worst, "worst_got": float(got[worst]) if diff.size else None,
            "worst_want": float(want[worst]) if diff.size else None}


def load_params(prefix: str, rank: int) -> np.ndarray:
    return np.load(f"{prefix}-rank{rank}.npy", allow_pickle=False)


def check_all(done: list[tuple[str, int, str]], ref_prefix: str, workers: int, per_slice: bool,
              rtol: float, atol: float) -> list[dict]:
    """Compare every rank of every launch in ``done`` (contender, launch, file prefix)
    with its reference and each of ours with DDP of the same round. ``checked``: a
    mismatch fails the run; the other comparisons are reported only.

    - DDP and ours with workers updating (torch SGD): against the torch-SGD reference,
      and ours against DDP; all checked.
    - ours with servers updating: against the single-process loop with the servers'
      update on a ``local`` store (``reference-kvsgd``: the Trainer with
      ``update_on_kvstore=True``; checked). The servers run torch SGD's twin (torch's
      own step, bit for bit), so their distance from the torch-SGD reference and from
      DDP, reported, is rounding only (0 at W=2: ResNet-20, VGG-11).
    - the floor: against the torch-SGD reference only where one pass on W*b is what the
      reference computes (no BatchNorm, no dropout)."""
    checks = []
    refs = {}
    for which, path in (("reference", ref_prefix), ("reference-kvsgd", f"{ref_prefix}-kvsgd")):
        try:
            refs[which] = load_params(path, 0)
        except (OSError, ValueError) as e:
            return [{"contender": name, "launch": launch, "rank": 0, "against": which,
                     "checked": True, "ok": False, "why": f"no {which}: {e}"}
                    for name, launch, _ in done]
    ddp = {launch: prefix for name, launch, prefix in done if name == "ddp"}
    for name, launch, prefix in done:
        kind, servers_update = CONTENDERS[name].kind, CONTENDERS[name].update_on_kvstore
        if kind == "floor" and per_slice:
            continue
        for rank in range(1 if kind == "floor" else workers):
            params = load_params(prefix, rank)
            against = [("reference", refs["reference"], not servers_update)]
            if servers_update:
                against.append(("reference-kvsgd", refs["reference-kvsgd"], True))
            if kind == "ours" and launch in ddp:
                against.append(("ddp", load_params(ddp[launch], rank), not servers_update))
            for which, want, checked in against:
                checks.append({"contender": name, "launch": launch, "rank": rank, "against": which,
                               "checked": checked, **compare(params, want, rtol, atol)})
    return checks


def verdict(checks: list[dict], failures: list[str], per_slice: bool, rtol: float,
            atol: float) -> dict:
    """The run's correctness: per contender, the number of checked comparisons, whether
    they all passed and the largest difference against each reference. A checked
    comparison that failed is appended to ``failures`` (a WRONG RESULT line); ok is
    False when anything at all failed (``failures`` includes the run's other failures)."""
    if not checks and not failures:
        failures.append("nothing was checked")
    by: dict[str, dict[str, Any]] = {}     # contender -> its verdict
    for c in checks:
        b = by.setdefault(c["contender"], {"checks": 0, "ok": True, "max_abs": {}, "checked": {}})
        b["checks"] += c["checked"]
        if c["checked"]:
            b["ok"] = b["ok"] and c["ok"]
        b["checked"][c["against"]] = c["checked"]
        if c.get("max_abs") is not None:
            b["max_abs"][c["against"]] = max(b["max_abs"].get(c["against"], 0.0), c["max_abs"])
        if c["checked"] and not c["ok"]:
            failures.append(f"WRONG RESULT: {c['contender']} launch {c['launch'] + 1} rank "
                            f"{c['rank']} differs from {c['against']}: {c}")
    return {"ok": bool(checks) and not failures,
            "reference": ("W per-worker slices of the concatenated batch, losses averaged "
                          "(BatchNorm/dropout per worker)" if per_slice else
                          "one forward pass on the concatenated batch of W*b"),
            "rtol": rtol, "atol": atol, "by_contender": by, "checks": checks}

"""Shared pieces of the contenders: the run configuration, Skip, result rows."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


class Skip(Exception):
    """This contender cannot run here; the message says why (printed, not fatal)."""


class Failed(RuntimeError):
    """The contender ran and failed (crash, timeout or a wrong sum): the run fails."""


@dataclass(frozen=True)
class RunConfig:
    workers: int = 2
    servers: int = 2
    model: str = "resnet50"
    iters: int = 10
    warmup: int = 3
    latency_iters: int = 200
    latency_sizes: tuple[int, ...] = (1, 1024, 16384)   # fp32 values per key
    async_size: int = 1024
    async_pushes: int = 500
    async_reps: int = 3
    transports: tuple[str, ...] = ("tcp", "ipc", "shm", "hosts")
    compression: tuple[str, ...] = ("2bit", "1bit", "fp16")   # ours: pushpull with each, tcp and shm
    work_dir: str = "/tmp"           # logs and per-launch JSON files
    timeout: float = 600.0           # per launch
    profile: bool = False
    env: dict = field(default_factory=dict)

    def worker_args(self) -> list[str]:
        return ["--model", self.model, "--iters", str(self.iters), "--warmup", str(self.warmup),
                "--latency-iters", str(self.latency_iters),
                "--latency-sizes", ",".join(map(str, self.latency_sizes))]

    def async_args(self) -> list[str]:
        return ["--task", "async", "--async-size", str(self.async_size),
                "--async-pushes", str(self.async_pushes), "--async-reps", str(self.async_reps)]

    def path(self, name: str) -> str:
        return os.path.join(self.work_dir, name)


def read_result(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise Failed(f"{what} finished but wrote no result ({path}): {e}") from None


def rows_from(result: dict, contender: str, launch: int, variants: dict, nbytes: int,
              extra: dict | None = None) -> list[dict]:
    """Rows for a worker's result JSON: one per exchange mode (``variants`` maps
    mode -> shown name), one per latency size, one for async updates."""
    rows = []
    for mode, data in result.get("modes", {}).items():
        rows.append({"kind": "exchange", "contender": contender, "variant": variants.get(mode, mode),
                     "launch": launch, "samples": data["times"], "unit": "s", "bytes": nbytes,
                     "cpu_s": data.get("cpu_s"), "minor_faults": data.get("minor_faults"),
                     "bytes_sent": data.get("bytes_sent"), "bytes_received": data.get("bytes_received"),
                     **(extra or {})})
    for size, times in result.get("latency", {}).items():
        rows.append({"kind": "latency", "contender": contender, "variant": f"{int(size)} B",
                     "launch": launch, "samples": times, "unit": "s", "bytes": int(size),
                     **(extra or {})})
    if "async" in result:
        a = result["async"]
        rows.append({"kind": "async", "contender": contender,
                     "variant": f"{a['size_bytes']} B key, SGD", "launch": launch,
                     "samples": a["updates_per_s"], "unit": "updates/s", "bytes": a["size_bytes"],
                     **(extra or {})})
    return rows

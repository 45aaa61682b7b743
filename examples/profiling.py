"""fit.py's --profile-worker-suffix and --profile-server-suffix.

- ``--profile-worker-suffix FILE``: each worker records its whole training run with
  torch's profiler and writes a Chrome trace (chrome://tracing, Perfetto), as MXNet's
  profiler does, to FILE (one worker) or ``rank<R>_FILE`` in FILE's directory.
- ``--profile-server-suffix NAME``: the servers profile their request loops
  (``kv._send_command_to_servers("profile_start")``) from the start of training to
  its end, when every worker has finished (a barrier), then each writes
  ``server-<rank>-NAME.prof`` (pstats) into its own ``KVSTORE_PROFILE_DIR``
  (``profile_dump``; no path travels to a server). NAME is up to 64 of
  ``A-Z a-z 0-9 _ -``; one extension (``.json``, as MXNet's examples write) is
  dropped. A store without servers (local, device) has nothing to profile: the log
  says so.

    profiling = Profiling.from_args(args, kv, device)    # ValueError for a bad suffix
    profiling.start()
    ...                                                  # train
    profiling.stop()
"""

from __future__ import annotations

import logging
import os
import re

import torch

log = logging.getLogger("fit")

LABEL = re.compile(r"[A-Za-z0-9_-]{1,64}")   # what a server accepts as part of its file name


def server_label(suffix: str) -> str:
    """The label of ``--profile-server-suffix suffix``: a name, not a path; one extension
    dropped. Raises ValueError for anything else."""
    if "/" in suffix or "\\" in suffix:
        raise ValueError(f"--profile-server-suffix {suffix!r}: a name, not a path (the servers write into "
                         f"their own KVSTORE_PROFILE_DIR; no path travels to them)")
    label = os.path.splitext(suffix)[0]
    if not LABEL.fullmatch(label):
        raise ValueError(f"--profile-server-suffix {suffix!r}: expected up to 64 of A-Z a-z 0-9 _ - "
                         f"(and one extension), e.g. server_profile")
    return label


def worker_trace_path(suffix: str, rank: int, num_workers: int) -> str:
    """``--profile-worker-suffix``: ``suffix`` itself for one worker, else ``rank<R>_``
    before its file name (MXNet's naming)."""
    if num_workers <= 1:
        return suffix
    head, tail = os.path.split(suffix)
    return os.path.join(head, f"rank{rank}_{tail}")


class Profiling:
    """Worker and server profiling of one training run (module docstring)."""

    def __init__(self, kv, device: torch.device, worker_suffix: str = "", server_suffix: str = ""):
        self.kv = kv
        self.trace_path = worker_trace_path(worker_suffix, kv.rank, kv.num_workers) if worker_suffix else None
        self.label = server_label(server_suffix) if server_suffix else None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities) if self.trace_path else None

    @classmethod
    def from_args(cls, args, kv, device: torch.device) -> Profiling:
        return cls(kv, device, getattr(args, "profile_worker_suffix", ""), getattr(args, "profile_server_suffix", ""))

    def _sends(self) -> bool:
        """Whether this worker talks to the servers: the first member, in a store that has them."""
        return "dist" in self.kv.type and self.kv.rank == self.kv.members[0]

    def start(self) -> None:
        if self.label is not None:
            if "dist" not in self.kv.type:
                log.info("--profile-server-suffix: the %r store has no servers to profile", self.kv.type)
            elif self._sends():
                self.kv._send_command_to_servers("profile_start")
        if self._profiler is not None:
            self._profiler.start()

    def stop(self) -> None:
        if self._profiler is not None and self.trace_path is not None:
            self._profiler.stop()
            self._profiler.export_chrome_trace(self.trace_path)
            log.info("worker profile written to %s", self.trace_path)
        if self.label is not None and "dist" in self.kv.type:
            self.kv.barrier()                      # every worker's requests are in the profiles
            if self._sends():
                self.kv._send_command_to_servers("profile_stop")
                for path in self.kv._send_command_to_servers("profile_dump", self.label):
                    log.info("server profile written to %s (on the server's host)", path)

"""The workload of benchmarks/chaos/run.py: rounds of exact sums, checked every round.

    python -m tracker.local -n 3 -s 2 python benchmarks/chaos/worker.py --mode sync
    python -m tracker.local -n 3 -s 2 --elastic 2:3 --max-restarts 1 \\
        python benchmarks/chaos/worker.py --mode sync --rounds 60 --every 10

Each worker pushes values that are exact in float32 and checks what it pulls: in
sync mode the sum of every worker's push of the round, in async mode (SGD with
learning rate 1 on the servers) a value that only ever decreases by whole
pushes. A wrong value prints ``WRONG ...`` and exits with status 3. Every round
prints ``round N ok``. With CHAOS_FAULT=exit|raise and CHAOS_RANK=r, worker r
exits with status 1 or raises an uncaught exception after CHAOS_AFTER rounds
(the runner's in-process faults; never a worker that joined the running job);
signals come from the runner.

Elastic jobs (``--every K``, docs/elastic.md): every K rounds each member
records the round (``kv.save_progress``) and passes ``kv.barrier()``; a worker
that joined the running job (a replacement) meets the others at such a barrier,
takes their round from ``kv.progress`` and works to the end. With
``--await-members W`` the workers go on past ``--rounds``, to the first barrier
where the job has W members again (a replacement joined) or ``--await-seconds``
have passed since the last round: a replacement that starts slowly (a loaded
machine) still finds a running job to join. Workers leave, so
in sync mode a round holds the pushes of some of the workers only; each element
must then be (step % 97 + 1) times a sum of distinct r + 1 over a set of slots
that :class:`Shares` allows (see there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import kvstore
from kvstore import optimizer as opt

SHAPES = [(1000,), (300, 7), (20_000,)]


class Shares:
    """Elastic dist_sync: whose pushes each element's round may hold. A worker that
    leaves takes its share out of the rounds after its last push (per key, even per
    server: it may die between two of its pushes), and only a barrier brings a
    share in (a joiner becomes a member there, and a member that left never comes
    back). So an element's round holds the pushes of a set of the last barrier's
    members that contains this worker, and between barriers that set only shrinks.

    Sums of distinct r + 1 are ambiguous (1 + 4 = 2 + 3): each element keeps every
    set (a bitmask of slots) its rounds since the barrier allow, and a value that
    no set it allows explains is wrong. Elements share few histories, so the sets
    are interned and each element holds an id."""

    def __init__(self, rank: int, slots: int, size: int):
        mine = [s for s in range(1 << slots) if s >> rank & 1]
        self.by_sum: dict[int, list[int]] = {}        # share sum -> the sets that make it
        for s in mine:
            self.by_sum.setdefault(sum(r + 1 for r in range(slots) if s >> r & 1), []).append(s)
        self.top = max(self.by_sum)
        self.sets: list[frozenset] = []               # interned sets of sets
        self.ids: dict[frozenset, int] = {}
        self.moves: dict[tuple[int, int], int] = {}   # (set id, sum seen) -> set id; -1: none
        self.state = np.zeros(size, np.int64)

    def barrier(self, members) -> None:
        """After a barrier: any set of ``members`` that holds this worker."""
        mask = sum(1 << r for r in members)
        start = frozenset(s for sets in self.by_sum.values() for s in sets if s & mask == s)
        self.state[:] = self._intern(start)

    def allows(self, sums: np.ndarray) -> np.ndarray:
        """Advance each element to the sets its round's ``sums`` (the value over
        step % 97 + 1; any number) allows; a boolean array, False where none does
        (such an element keeps its sets)."""
        whole = (sums == np.round(sums)) & (sums >= 1) & (sums <= self.top)
        seen = np.where(whole, sums, 0).astype(np.int64)
        pairs, where = np.unique(self.state * (self.top + 1) + seen, return_inverse=True)
        moved = np.array([self._move(*divmod(int(p), self.top + 1)) for p in pairs],
                         np.int64)[where.ravel()]
        ok = whole & (moved >= 0)
        self.state = np.where(ok, moved, self.state)
        return ok

    def _move(self, sid: int, total: int) -> int:
        if (sid, total) not in self.moves:
            now = frozenset(s for s in self.by_sum.get(total, ())
                            if any(s & before == s for before in self.sets[sid]))
            self.moves[sid, total] = self._intern(now) if now else -1
        return self.moves[sid, total]

    def _intern(self, sets: frozenset) -> int:
        if sets not in self.ids:
            self.ids[sets] = len(self.sets)
            self.sets.append(sets)
        return self.ids[sets]


def wrong_keys(keys, outs, step: int, mine: float, num_workers: int, last, shares: Shares | None) -> list:
    """The keys whose pulled value is wrong for this round (``last``: async's previous pulls)."""
    if shares is not None:    # elastic sync: sums of the shares a round may hold
        ok = shares.allows(np.concatenate([o.ravel() for o in outs]) / np.float32(step % 97 + 1))
        cuts = np.cumsum([o.size for o in outs])[:-1]
        return [k for k, part in zip(keys, np.split(ok, cuts)) if not part.all()]
    if last is None:          # sync: every worker's push
        want = float(sum((r + 1) * (step % 97 + 1) for r in range(num_workers)))
        return [k for k, o in zip(keys, outs) if not (o == want).all()]
    # async: each applied push subtracts a positive whole number: down, integral, uniform
    bad = [k for k, o, prev in zip(keys, outs, last)
           if not ((o <= prev - mine).all() and (o == np.round(o)).all() and (o == o.flat[0]).all())]
    for prev, o in zip(last, outs):
        np.copyto(prev, o)
    return bad


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--rounds", type=int, default=100_000)
    p.add_argument("--every", type=int, default=0,
                   help="elastic jobs: save the round and pass a barrier every this many rounds [0: never]")
    p.add_argument("--await-members", type=int, default=0,
                   help="elastic jobs: past --rounds, go on to a barrier with this many members [0: do not]")
    p.add_argument("--await-seconds", type=float, default=45.0,
                   help="the longest wait for --await-members past --rounds, in seconds")
    args = p.parse_args()
    fault, fault_rank = os.environ.get("CHAOS_FAULT"), int(os.environ.get("CHAOS_RANK", "-1"))
    after = int(os.environ.get("CHAOS_AFTER", "0"))
    kv = kvstore.create("dist_sync" if args.mode == "sync" else "dist_async")
    from kvstore.worker.dist import DistStore   # imported by create already (a server never gets here)
    assert isinstance(kv, DistStore)   # what dist_sync and dist_async build
    keys = list(range(len(SHAPES)))
    kv.init(keys, [np.zeros(s, np.float32) for s in SHAPES])
    if args.mode == "async":
        kv.set_optimizer(opt.SGD(learning_rate=1.0))
    outs = [np.empty(s, np.float32) for s in SHAPES]
    last = [np.zeros(s, np.float32) for s in SHAPES] if args.mode == "async" else None
    shares = None
    if kv.elastic is not None and args.mode == "sync":
        shares = Shares(kv.rank, kv.elastic[1], sum(o.size for o in outs))
        shares.barrier(kv.members)
    print(f"ready rank {kv.rank} pid {os.getpid()}", flush=True)
    step, joining, give_up = 0, kv.joined, None
    # past --rounds with --await-members, each barrier decides whether to go on
    while step < args.rounds or args.every and args.await_members:
        if step >= args.rounds and give_up is None:
            give_up = time.monotonic() + args.await_seconds
        if args.every and (joining or step % args.every == 0):
            # every member saves (the same round): kv.members is as of the last
            # barrier, and its first one may have left since
            if not joining:
                kv.save_progress({"round": step})
            kv.barrier()
            if joining:
                step, joining = kv.progress["round"], False
                print(f"joined the running job at round {step}, members {list(kv.members)}", flush=True)
            if shares is not None:
                shares.barrier(kv.members)
            if step >= args.rounds and (len(kv.members) >= args.await_members
                                        or give_up is not None and time.monotonic() > give_up):
                break   # members decide alike (kv.members is the barrier's); one that
                        # gives up first finishes, and a finished worker has left
        if kv.rank == fault_rank and step == after and not kv.joined:
            if fault == "exit":
                print("chaos: exiting with status 1", flush=True)
                sys.exit(1)
            if fault == "raise":
                raise RuntimeError("chaos: an uncaught exception in the training loop")
        mine = float((kv.rank + 1) * (step % 97 + 1))
        kv.pushpull(keys, [np.full(s, mine, np.float32) for s in SHAPES], out=outs)
        bad = wrong_keys(keys, outs, step, mine, kv.num_workers, last, shares)
        if bad:
            print(f"WRONG round {step} keys {bad}: {[o.flat[:3].tolist() for o in outs]}", flush=True)
            return 3
        print(f"round {step} ok", flush=True)
        step += 1
    if args.every:
        kv.save_progress({"round": step})   # a worker joining now has nothing left to do
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

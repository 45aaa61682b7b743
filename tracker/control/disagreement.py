"""Workers that disagree at a collective call: where their calls first differ, and
which worker is blamed.

A collective call's barrier token is short (a digest once it is long), so the
scheduler's answer when tokens differ (``workers disagree at a collective call:
worker 0: 'init 0:(16, 16):float32, ... #3fa2'; worker 1: ...``) may show nothing
but two digests. The workers then exchange what they called, item by item (each
key's shape and dtype), and each raises the same error, written here::

    workers disagree at a collective call (init): worker 1 differs from worker 0 at
    item 6 (of 10): worker 0 has key 6 (64, 16) float32, worker 1 has key 6 (32, 16) float32

The worker blamed is the same every run: the lowest-ranked one whose call differs
from the most common call (the lowest rank's among equally common ones): with two
workers, worker 1. :func:`blamed` finds it in a quoted message, so that the
launcher marks it as the root cause whichever worker's report came first.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Hashable, Mapping

PHRASE = "workers disagree at a collective call"   # the scheduler's answer starts so (records.py)

_BLAMED = re.compile(PHRASE + r"(?: \([^)]*\))?: worker (\d+) differs from worker \d+")


def encode(head: str, items) -> bytes:
    """What one worker called, as the bytes it sends to the others."""
    return json.dumps([head, [str(i) for i in items]]).encode()


def decode(data: bytes) -> tuple[str, tuple[str, ...]]:
    """:func:`encode`'s bytes back; ValueError if they are not."""
    head, items = json.loads(data.decode())
    if not isinstance(head, str) or not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError("not a collective call's description")
    return head, tuple(items)


def describe(calls: dict[int, tuple[str, tuple[str, ...]]]) -> str | None:
    """The error for workers (rank -> (head, items)) whose calls differ: the worker
    blamed, the one it differs from, and the first item where they differ (index,
    both sides). None if the calls are all the same."""
    if len(set(calls.values())) < 2:
        return None
    ref, odd = odd_ones(calls)
    blamed = odd[0]
    (head_a, items_a), (head_b, items_b) = calls[ref], calls[blamed]
    more = f" (so do worker{'s' if len(odd) > 2 else ''} {', '.join(map(str, odd[1:]))})" if len(odd) > 1 else ""
    if head_a != head_b:
        return (f"{PHRASE}: worker {blamed} differs from worker {ref}{more}: worker {ref} called "
                f"{_call(head_a, items_a)}, worker {blamed} called {_call(head_b, items_b)}")
    at = next((i for i, (a, b) in enumerate(zip(items_a, items_b)) if a != b), min(len(items_a), len(items_b)))

    def has(rank: int, items: tuple[str, ...]) -> str:
        return items[at] if at < len(items) else f"no item {at} (it has {len(items)})"
    count = f"of {len(items_a)}" if len(items_a) == len(items_b) else f"worker {ref} has {len(items_a)}, " \
        f"worker {blamed} {len(items_b)}"
    return (f"{PHRASE} ({head_a}): worker {blamed} differs from worker {ref}{more} at item {at} ({count}): "
            f"worker {ref} has {has(ref, items_a)}, worker {blamed} has {has(blamed, items_b)}")


def odd_ones(calls: Mapping[int, Hashable]) -> tuple[int, list[int]]:
    """``(reference, odd)``: the lowest rank of the most common call (the lowest
    rank's among equally common ones) and the ranks whose call differs from it, in
    order; the first of those is the worker blamed."""
    ranks = sorted(calls)
    counts = Counter(calls.values())
    common = calls[max(ranks, key=lambda r: (counts[calls[r]], -r))]
    return min(r for r in ranks if calls[r] == common), [r for r in ranks if calls[r] != common]


def _call(head: str, items: tuple[str, ...]) -> str:
    return repr(head) + (f" with {len(items)} item{'s' if len(items) != 1 else ''}" if items else "")


def quoted(text: str | None) -> str | None:
    """The disagreement a failure report quotes (``worker 1 (...) failed:
    InvalidArgumentError: workers disagree ...``: from the phrase on), or None. A
    worker whose exchange was cut short by the job's abort (another worker, done
    with it, reported the error first) raises the same error from it."""
    at = (text or "").find(PHRASE)
    return None if at < 0 or not _BLAMED.match(text or "", at) else (text or "")[at:]


def blamed(text: str | None) -> list[str]:
    """The worker (``['worker 1']``) a disagreement quoted in ``text`` blames; []
    if it quotes none."""
    m = _BLAMED.search(text or "")
    return [f"worker {m[1]}"] if m else []

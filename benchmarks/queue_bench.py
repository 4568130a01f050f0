"""FairQueue removal and expiry: CPU time of the O(log n) queue against the one it replaced (issue 17).

    .venv/bin/python benchmarks/queue_bench.py [--repeat N] [--removals R]

``old`` is ``ReferenceQueue`` from tests/solver/test_queue.py (the queue before issue 17, which re-tags
every later item of a class on each removal); ``new`` is ``toposched.solver.queue.FairQueue``. Each run
builds both queues from the same seeded pushes (items spread over the four classes, costs 1-8 GPUs,
occupancy 0-1) and times the same operations on each with ``time.process_time``:

* ``remove @ depth D``: R removals of random waiting items from a queue of D items (per removal);
* ``first remove @ 10,000``: one removal right after 10,000 pushes, in the new queue including the
  catch-up of its class's tree with those pushes (deferred from ``push``, which is O(1));
* ``expire all of 10,000``: one ``expire`` call that times out every one of 10,000 items;
* ``expire 1 of 10,000``: ``expire`` calls that each time out the oldest item of ~10,000 (per call);
* ``push+pop @ depth 1,000``: one push and one pop, the path with no removal (per pair).

Figures are medians of N runs (default 5); ``old/new`` is the median of the per-run ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/ is a package

from tests.solver.test_queue import ReferenceQueue

from toposched.solver.queue import SLO_ORDER, FairQueue
from toposched.solver.queueline import QueuedItem
from toposched.solver.request import SloClass


class Queue(Protocol):
    def push(
        self, item_id: str, slo_class: SloClass, cost_gpus: float, occupancy: float = 0.0, *, enqueued_at: float = 0.0
    ) -> QueuedItem: ...
    def pop(self) -> QueuedItem | None: ...
    def remove(self, item_id: str) -> QueuedItem | None: ...
    def expire(self, now: float, timeout: float) -> list[QueuedItem]: ...


def filled(make: Callable[[], Queue], depth: int, seed: int, *, settle: bool = True) -> Queue:
    """``depth`` items, enqueued at times 0 .. depth-1. ``settle``: then push and remove one item per
    class, so the new queue's trees have caught up with the pushes (see ``first remove``)."""
    rng = random.Random(seed)
    queue = make()
    for n in range(depth):
        queue.push(f"i{n}", rng.choice(SLO_ORDER), float(rng.randint(1, 8)), rng.random(), enqueued_at=float(n))
    if settle:
        for slo_class in SLO_ORDER:
            queue.push(f"settle-{slo_class}", slo_class, 1.0, enqueued_at=float(depth))
            queue.remove(f"settle-{slo_class}")
    return queue


def cpu(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def removals(make: Callable[[], Queue], depth: int, count: int, seed: int) -> float:
    queue = filled(make, depth, seed)
    victims = random.Random(seed + 1).sample(range(depth), count)

    def run() -> None:
        for n in victims:
            queue.remove(f"i{n}")

    return cpu(run) / count


def first_remove(make: Callable[[], Queue], depth: int, seed: int) -> float:
    """The first removal after ``depth`` pushes: the new queue's tree of that class catches up first
    (O(pushes to that class), the pushes' deferred cost)."""
    queue = filled(make, depth, seed, settle=False)
    return cpu(lambda: queue.remove(f"i{depth // 2}"))


def expire_all(make: Callable[[], Queue], depth: int, seed: int) -> float:
    queue = filled(make, depth, seed)
    return cpu(lambda: queue.expire(now=float(depth) + 100.0, timeout=10.0))


def expire_one(make: Callable[[], Queue], depth: int, calls: int, seed: int) -> float:
    queue = filled(make, depth, seed)

    def run() -> None:
        for k in range(calls):  # call k times out i<k> alone (enqueued at k; the earlier ones are gone)
            assert len(queue.expire(now=k + 10.5, timeout=10.0)) == 1

    return cpu(run) / calls


def push_pop(make: Callable[[], Queue], depth: int, count: int, seed: int) -> float:
    queue = filled(make, depth, seed)
    rng = random.Random(seed + 2)
    classes = [rng.choice(SLO_ORDER) for _ in range(count)]

    def run() -> None:
        for n, slo_class in enumerate(classes):
            queue.push(f"p{n}", slo_class, 2.0, 0.5, enqueued_at=float(depth + n))
            queue.pop()

    return cpu(run) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--removals", type=int, default=50, help="removals timed per run (default 50)")
    args = parser.parse_args()
    cases: list[tuple[str, str, Callable[[Callable[[], Queue], int], float]]] = [
        ("remove @ depth 1,000", "us/op", lambda make, seed: removals(make, 1_000, args.removals, seed)),
        ("remove @ depth 10,000", "us/op", lambda make, seed: removals(make, 10_000, args.removals, seed)),
        ("first remove @ 10,000", "ms", lambda make, seed: first_remove(make, 10_000, seed)),
        ("expire all of 10,000", "ms", lambda make, seed: expire_all(make, 10_000, seed)),
        ("expire 1 of 10,000", "us/op", lambda make, seed: expire_one(make, 10_000, 100, seed)),
        ("push+pop @ depth 1,000", "us/op", lambda make, seed: push_pop(make, 1_000, 2_000, seed)),
    ]
    print(f"CPU time (time.process_time), medians of {args.repeat} runs")
    print(f"{'case':<24} {'unit':>5} {'old':>10} {'new':>10} {'old/new':>9}")
    for name, unit, case in cases:
        scale = 1e3 if unit == "ms" else 1e6
        old, new, ratios = [], [], []
        for seed in range(args.repeat):
            o, n = case(ReferenceQueue, seed), case(FairQueue, seed)
            old.append(o * scale)
            new.append(n * scale)
            ratios.append(o / n if n > 0 else float("inf"))
        print(
            f"{name:<24} {unit:>5} {statistics.median(old):>10.1f} {statistics.median(new):>10.1f}"
            f" {statistics.median(ratios):>8.1f}x"
        )


if __name__ == "__main__":
    main()

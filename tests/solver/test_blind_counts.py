"""The blind policies pick through the node level's ``FreeCounts`` (a Fenwick tree) when no node filter
applies: the same GPUs ``index-order`` took from the list of nodes with room, uniform free GPUs for
``random``, and the tree always equal to the nodes' free counts."""

from __future__ import annotations

import random
from collections import Counter

from tests.solver.builders import make_scheduler
from toposched.solver import policies
from toposched.solver import scheduler as sched
from toposched.solver.index import FreeCounts
from toposched.solver.request import PlacementRequest


def test_free_counts_match_a_plain_list_under_random_changes() -> None:
    rng = random.Random(7)
    counts = [rng.randint(0, 8) for _ in range(37)]
    tree = FreeCounts(counts)
    for _ in range(2000):
        g = rng.randrange(len(counts))
        delta = rng.choice((-1, 1)) if counts[g] else 1
        counts[g] += delta
        tree.add(g, delta)
        assert tree.total == sum(counts)
        if tree.total:
            k = rng.randint(1, tree.total)
            prefix, want = 0, None
            for i, c in enumerate(counts):
                prefix += c
                if prefix >= k:
                    want = i
                    break
            assert tree.find(k) == want


def _busy_scheduler(seed: int) -> sched.Scheduler:
    s = make_scheduler(nodes=16, seed=seed)
    rng = random.Random(seed)
    for n in range(40):
        tp = rng.choice((1, 2, 4))
        s.place(PlacementRequest(id=f"f{n}", model="llama-3.1-8b", allowed_tp=(tp,)), "slo")
    for pid in rng.sample(sorted(s.placements), 12):
        s.release(pid)
    return s


def test_index_order_takes_the_same_gpus_as_the_scan_of_nodes_with_room() -> None:
    for seed in range(5):
        s = _busy_scheduler(seed)
        nodes = s.index.levels["node"]
        usable = [(nodes.groups[i], nodes.free_count[i]) for i in nodes.with_free()]
        for n in (1, 3, 8, 20):
            assert policies._lowest_free(s, n) == policies._lowest_indices(s, usable, n)
        assert nodes.counts is not None and nodes.counts.total == len(s.index.free)


def test_random_takes_distinct_free_gpus_each_equally_often() -> None:
    s = _busy_scheduler(3)
    free = sorted(s.index.free)
    seen: Counter[str] = Counter()
    for _ in range(3000):
        chosen = policies._random_free(s, 4)
        assert len(set(chosen)) == 4 and set(chosen) <= s.index.free
        seen.update(chosen)
    assert s.index.levels["node"].counts.total == len(free)  # type: ignore[union-attr]  # restored
    mean = 4 * 3000 / len(free)
    assert set(seen) == set(free) and all(0.75 * mean < c < 1.25 * mean for c in seen.values())


def test_blind_policies_place_on_the_tree_path_and_keep_it_in_step() -> None:
    s = make_scheduler(nodes=4)
    for policy in ("index-order", "random"):
        for n in range(6):
            out = s.place(PlacementRequest(id=f"{policy}{n}", model="llama-3.1-8b", allowed_tp=(2,)), policy)
            assert out.placements
    nodes = s.index.levels["node"]
    assert nodes.counts is not None
    assert [nodes.counts.find(k) for k in range(1, nodes.counts.total + 1)] == [
        g for g, c in enumerate(nodes.free_count) for _ in range(c)
    ]

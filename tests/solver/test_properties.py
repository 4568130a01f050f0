"""Solver invariants under random sequences of placements and releases (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster
from toposched.topology.presets import hgx, nvlink_pairs_4gpu

CLUSTER = Cluster(
    nodes=(
        hgx("a", "NVIDIA H100 80GB HBM3", 79.65, rack="r0"),
        hgx("b", "NVIDIA H100 80GB HBM3", 79.65, rack="r1"),
        nvlink_pairs_4gpu("c"),
    )
)

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("place"),
            st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b"]),
            st.sampled_from([None, (1,), (2,), (4,), (8,)]),
            st.sampled_from(["slo", "latency", "index-order", "random"]),
            st.integers(1, 3),
        ),
        st.tuples(st.just("release"), st.integers(0, 20)),
    ),
    max_size=10,
)


def _check(s: Scheduler) -> None:
    accounts = s.ledger.accounts()
    assert all(0 <= a.reserved_bytes <= a.capacity_bytes for a in accounts.values())
    held = {ref for ref, a in accounts.items() if a.reserved_bytes > 0}
    assert held.isdisjoint(s.index.free)
    assert held | s.index.free == set(s.index.info)
    for p in s.placements.values():
        assert len(set(p.gpu_refs)) == len(p.gpu_refs) == p.tp * p.pp
        if p.policy in ("slo", "latency"):
            for stage in range(p.pp):
                refs = [f"{r.node}/{r.gpu}" for r in p.ranks if r.stage == stage]
                assert s.index.tightest_level(refs) == "nvlink"


def _run(sequence: list[tuple[object, ...]], seed: int) -> list[tuple[str, tuple[str, ...]]]:
    s = Scheduler(CLUSTER, seed=seed)
    log: list[tuple[str, tuple[str, ...]]] = []
    for n, op in enumerate(sequence):
        if op[0] == "place":
            _, model, tps, policy, replicas = op
            request = PlacementRequest(
                id=f"r{n}", model=str(model), allowed_tp=tps, replicas=int(replicas),  # type: ignore[arg-type]
                max_model_len=4096, concurrent_seqs=4, affinity="nvlink",
            )  # fmt: skip
            out = s.place(request, policy=str(policy))
            log.extend((p.id, p.gpu_refs) for p in out.placements)
        else:
            live = sorted(s.placements)
            if live:
                victim = live[int(op[1]) % len(live)]
                before_free = set(s.index.free)
                before_accounts = s.ledger.accounts()
                gpus = s.placements[victim].gpu_refs
                assert s.release(victim)
                assert s.index.free == before_free | set(gpus)
                after = s.ledger.accounts()
                assert all(after[r].reserved_bytes == 0 for r in gpus)
                assert all(after[r] == before_accounts[r] for r in after if r not in gpus)
                log.append(("release", gpus))
        _check(s)
    return log


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(0, 3))
def test_invariants_and_determinism(sequence: list[tuple[object, ...]], seed: int) -> None:
    assert _run(sequence, seed) == _run(sequence, seed)

"""Continuous batching of one instance (sim/batching.py): budgets, KV preemption, macro steps."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence

import pytest

from toposched.perf import get_gpu, get_link
from toposched.perf.step import StepCost
from toposched.sim.batching import Batcher
from toposched.sim.workload import SimRequest
from toposched.workload.catalog import resolve_model


class RecordingCost(StepCost):
    """A StepCost that remembers every step it was asked for."""

    def __init__(self) -> None:
        super().__init__(resolve_model("llama-3.1-8b"), get_gpu("H100-SXM"), tp=1, link=get_link("nvlink4"))
        self.steps: list[tuple[int, float, tuple[tuple[int, int], ...]]] = []

    def step_ms(
        self, *, decode_seqs: int = 0, decode_context: float = 0.0, chunks: Sequence[tuple[int, int]] = ()
    ) -> float:
        self.steps.append((decode_seqs, decode_context, tuple(chunks)))
        return super().step_ms(decode_seqs=decode_seqs, decode_context=decode_context, chunks=chunks)


def make_batcher(*, jump: bool = True, kv: int = 1_000_000, budget: int = 8192, seqs: int = 32) -> Batcher:
    return Batcher(RecordingCost(), max_seqs=seqs, max_batched_tokens=budget, kv_capacity=kv, timeout_s=1e6, jump=jump)


def drive(batcher: Batcher, requests: list[SimRequest], events: list[int] | None = None) -> list[SimRequest]:
    """Feed ``requests`` (by arrival) to one batcher, as the simulator does; returns them finished.

    ``events`` (if given) gets the number of step-end events that were applied.
    """
    applied = 0
    heap: list[tuple[float, int, int, str, SimRequest | None, int]] = []
    seq = itertools.count()
    version = 0
    for req in requests:
        heapq.heappush(heap, (req.arrival_s, 3, next(seq), "arrival", req, 0))

    def schedule(end: float | None) -> None:
        nonlocal version
        if end is not None:
            version += 1
            heapq.heappush(heap, (end, 1, next(seq), "step", None, version))

    def drop(req: SimRequest) -> None:
        req.state = "timed_out"

    while heap:
        now, _, _, kind, arriving, v = heapq.heappop(heap)
        if kind == "arrival":
            assert arriving is not None
            if batcher.busy:
                end = batcher.interrupt(now)
                batcher.waiting.append(arriving)
                schedule(end)
            else:
                batcher.waiting.append(arriving)
                schedule(batcher.compose(now, drop))
        elif v == version:
            applied += 1
            for done in batcher.finish(now):
                done.state = "done"
            schedule(batcher.compose(now, drop))
    if events is not None:
        events.append(applied)
    return requests


def req(id_: int, at: float, inp: int, out: int) -> SimRequest:
    return SimRequest(id=id_, arrival_s=at, input_len=inp, output_len=out, slo_class="interactive")


def tpot_ms(r: SimRequest) -> float:
    return 1000 * (r.finish_s - r.first_token_s) / (r.output_len - 1)


def test_a_lone_request_decodes_faster_than_one_in_a_full_batch() -> None:
    (alone,) = drive(make_batcher(), [req(0, 0.0, 512, 128)])
    crowd = drive(make_batcher(), [req(i, 0.0, 512, 128) for i in range(32)])
    assert alone.state == "done" and all(r.state == "done" for r in crowd)
    assert tpot_ms(alone) < min(tpot_ms(r) for r in crowd)
    assert alone.first_token_s > 0  # one prefill step before the first token


def test_ttft_grows_with_the_queue() -> None:
    # 64 requests at once, 8 sequences at most: later ones wait for earlier ones to finish
    done = drive(make_batcher(seqs=8), [req(i, 0.0, 512, 64) for i in range(64)])
    ttft = [r.ttft_s for r in done]
    assert ttft[-1] > ttft[8] > ttft[0]
    assert ttft == sorted(ttft)  # first come, first served
    assert all(r.state == "done" for r in done)


def test_chunked_prefill_respects_the_token_budget() -> None:
    b = make_batcher(budget=512)
    done = drive(b, [req(0, 0.0, 2000, 8), req(1, 0.0, 300, 8), req(2, 0.001, 100, 8)])
    cost = b.cost
    assert isinstance(cost, RecordingCost)
    tokens = [d + sum(n for _, n in chunks) for d, _, chunks in cost.steps]
    assert max(tokens) <= 512
    first = [chunks for _, _, chunks in cost.steps if chunks and chunks[0][0] == 0 and chunks[0][1] == 512]
    assert first, "a 2,000-token prompt is split into chunks of the budget"
    # its chunks continue where the previous one stopped: (0, 512), (512, 512), (1024, 512), (1536, 464)
    offsets = [c for _, _, chunks in cost.steps for c in chunks if c[0] in (0, 512, 1024, 1536) and c[1] >= 464]
    assert [o for o, _ in offsets][:4] == [0, 512, 1024, 1536]
    assert all(r.state == "done" and r.generated == r.output_len for r in done)


def test_full_kv_preempts_the_newest_and_recomputes() -> None:
    # KV for 1,500 tokens: three requests of 400 + 300 tokens cannot all stay
    b = make_batcher(kv=1500)
    done = drive(b, [req(i, i * 0.001, 400, 300) for i in range(3)])
    assert all(r.state == "done" and r.generated == 300 for r in done)
    assert b.preemptions > 0
    victims = [r for r in done if r.preempted]
    assert victims and victims[0] is done[-1]  # the newest running sequence goes first
    cost = b.cost
    assert isinstance(cost, RecordingCost)
    # recompute: the victim comes back with one chunk of its prompt plus what it had generated
    resumed = [c for _, _, chunks in cost.steps for c in chunks if c[0] == 0 and c[1] > 400]
    assert resumed, cost.steps[:5]
    assert b.kv_used == 0 and not b.running and not b.waiting
    assert max(d for d, _, _ in cost.steps) <= 3


def workload(seed: int, n: int = 120) -> list[SimRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(20.0)
        out.append(req(i, t, rng.randint(20, 1500), rng.randint(1, 300)))
    return out


@pytest.mark.parametrize(("seed", "kv", "seqs"), [(1, 1_000_000, 32), (2, 6000, 16), (3, 1_000_000, 4)])
def test_macro_steps_equal_step_by_step(seed: int, kv: int, seqs: int) -> None:
    jumped = drive(make_batcher(kv=kv, seqs=seqs), workload(seed))
    stepped = drive(make_batcher(kv=kv, seqs=seqs, jump=False), workload(seed))
    for a, b in zip(jumped, stepped, strict=True):
        assert a.state == b.state == "done"
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-9, abs=1e-9)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-9, abs=1e-9)
        assert a.preempted == b.preempted
    b1, b2 = make_batcher(kv=kv, seqs=seqs), make_batcher(kv=kv, seqs=seqs, jump=False)
    events: list[int] = []
    drive(b1, workload(seed), events)
    drive(b2, workload(seed), events)
    assert b1.steps_done == b2.steps_done == events[1]  # the same engine steps ...
    # ... in fewer events; far fewer unless the KV is so small that the waiting line is always blocked
    assert events[0] < events[1] / (3 if kv > 100_000 else 1)


def test_a_sequence_arriving_with_its_kv_decodes_instead_of_prefilling() -> None:
    """A decode instance of a disaggregated deployment: a sequence that joins with its prompt's KV and a
    first token decodes its next token in a decode step (no prefill pass, no prefill overhead)."""
    batcher = make_batcher(jump=False)
    cost = batcher.cost
    assert isinstance(cost, RecordingCost)
    req = SimRequest(0, 0.0, 1000, 4, "interactive", computed=1000, generated=1)
    batcher.waiting.append(req)
    assert batcher.compose(0.0, lambda _r: None) is not None
    assert cost.steps[-1] == (1, 1000.0, ())  # one decode at context 1000, no chunk
    decode_only = cost.step_ms(decode_seqs=1, decode_context=1000.0)
    assert batcher.step_end == pytest.approx(decode_only / 1000.0)
    fresh = make_batcher(jump=False)
    fresh.waiting.append(SimRequest(1, 0.0, 1000, 4, "interactive"))
    fresh.compose(0.0, lambda _r: None)
    assert isinstance(fresh.cost, RecordingCost) and fresh.cost.steps[-1] == (0, 0.0, ((0, 1000),))

"""One instance under continuous batching with ``c`` sequences running (``ServingRun``): one request's TTFT,
a request's mean TPOT with arriving prompts riding along, and a benchmark run's output tokens/s.

The definitions, and the operating point chosen from them, are in ``perf/serving.py``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from toposched.perf.latency import PassModel, StepTime, prefill_chunks

CommAdjust = Callable[[float], float]
"""All-reduce milliseconds of a pass -> what the placement pays for them (compression, overlap)."""

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def exponential_lengths(mean: float, n: int) -> list[int]:
    """``n`` output lengths (at least 1 token) of mean ``mean``, exponentially distributed, in a fixed
    order that looks random (a low-discrepancy sequence: no RNG, the same lengths on every call).

    What stands for a dataset's varying completion lengths (ShareGPT without ``--ignore-eos``) when only
    their mean is known: the exponential is the maximum-entropy distribution of a positive length with a
    given mean. It matters for a finite run: the longest outputs decode at a small batch after the
    others finish, which a single mean length cannot show (docs/cost-model.md)."""
    if n < 1 or mean <= 0:
        return []
    raw = [-math.log(1.0 - ((i + 1) * _GOLDEN) % 1.0) for i in range(n)]
    scale = mean * n / sum(raw)
    return [max(1, round(x * scale)) for x in raw]


class ServingRun:
    """One instance with ``c`` concurrent sequences of ``isl`` in, ``osl`` out (``perf/serving.py``'s docstring).

    ``budget`` is the engine's batched-token limit per pass; ``comm`` rewrites the all-reduce time of
    each pass (a placement's compression and overlap, ``solver/place.py``); None: paid in full.
    """

    def __init__(
        self, model: PassModel, c: int, isl: int, osl: int, budget: int, comm: CommAdjust | None = None
    ) -> None:
        self.model, self.c, self.isl, self.osl, self.budget = model, c, isl, osl, budget
        self.context = isl + osl / 2
        self._comm = comm

    def _ms(self, step: StepTime | None) -> float:
        if step is None:
            return 0.0
        if self._comm is None:
            return step.total_ms
        return step.total_ms - step.comm_ms + self._comm(step.comm_ms)

    def decode_ms(self, seqs: int) -> float:
        """A decode step of ``seqs`` sequences at the mean context."""
        return self._ms(self.model.step(decode_seqs=seqs, decode_context=seqs * self.context))

    def ttft_ms(self, client: bool = True) -> float:
        """One prompt's prefill, with the other ``c - 1`` sequences decoding in the same passes; ``client``:
        as a client measures it (plus ``client_overhead_ms``), else as the engine's own metrics do."""
        riders = self.c - 1
        # the request arrives while the engine runs a step of the others and joins at the next
        # iteration boundary: on average half a step later
        ttft = self.decode_ms(riders) / 2
        done = 0
        while done < self.isl:
            n = min(self.budget - min(riders, self.budget - 1), self.isl - done)
            ttft += self._ms(
                self.model.step(decode_seqs=riders, decode_context=riders * self.context, chunks=[(done, n)])
            )
            done += n
        return ttft + (self.model.cfg.client_overhead_ms if client else 0.0)

    def first_wave_ttfts_ms(self, count: int | None = None, client: bool = True) -> list[float]:
        """The TTFTs of ``count`` (default ``c``) prompts that arrive together (a closed loop's start):
        prefilled in budget-sized passes in arrival order, each prompt's first token at the end of its
        last chunk's pass."""
        out: list[float] = []
        clock = self.model.cfg.client_overhead_ms if client else 0.0
        for chunks in prefill_chunks(self.c if count is None else count, self.isl, self.budget):
            clock += self._ms(self.model.step(chunks=chunks))
            out += [clock] * sum(1 for done, n in chunks if done + n == self.isl)
        return out

    def mean_ttft_ms(self, num_requests: int | None = None, client: bool = True) -> float:
        """The mean TTFT of a run: ``ttft_ms``; for a closed loop of ``num_requests`` the first ``c`` (or
        all of them, if fewer) start together (``first_wave_ttfts_ms``) and the rest arrive one at a time."""
        steady = self.ttft_ms(client)
        if num_requests is None or self.c <= 1:
            return steady
        wave = self.first_wave_ttfts_ms(min(self.c, num_requests), client)
        return (sum(wave) + (num_requests - len(wave)) * steady) / num_requests

    def tpot_ms(self, z: float = 0.0) -> float:
        """The decode step at batch ``c``, plus the other ``c - 1`` sequences' prefills riding along:
        each prefills once per ``osl`` steps, in a pass with the decodes.

        ``z > 0``: a quantile of one request's mean TPOT instead of the mean: the prefills a request
        shares its steps with arrive at random (Poisson, mean ``c - 1`` over its life), so it sees
        ``c - 1 + z sqrt(c - 1)`` of them at that quantile (``z = 1.645``: 95 %)."""
        decode = self.decode_ms(self.c)
        extra = 0.0
        if self.c > 1:
            done = 0
            while done < self.isl:
                n = min(self.budget, self.isl - done)
                mixed = self.model.step(decode_seqs=self.c, decode_context=self.c * self.context, chunks=[(done, n)])
                extra += self._ms(mixed) - decode
                done += n
        riders = self.c - 1
        return decode + (riders + z * math.sqrt(riders)) / self.osl * extra

    def batch_prefill_ms(self) -> float:
        """All ``c`` prompts prefilled together in budget-sized passes (a static batch's TTFT)."""
        return sum(self._ms(self.model.step(chunks=p)) for p in prefill_chunks(self.c, self.isl, self.budget))

    def batch_ms(self, b: int) -> float:
        """Closed loop: ``b`` prompts prefilled in budget-sized passes, then ``osl - 1`` decode steps."""
        per_pass = max(1, self.budget // self.isl)
        full = self.model.step(chunks=[(0, self.isl)] * per_pass) if self.isl <= self.budget else None
        if full is not None:
            prefill_ms = self._ms(full) * b / per_pass
        else:  # a prompt longer than the budget: its own chunked passes, one prompt after another
            prefill_ms = b * sum(self._ms(self.model.step(chunks=p)) for p in prefill_chunks(1, self.isl, self.budget))
        return prefill_ms + (self.osl - 1) * self.decode_ms(b)

    def queued_run_ms(self, output_lens: Sequence[int]) -> float:
        """Every request queued at once (an offline run, or a closed loop with ``N`` requests), at most
        ``c`` running: a request that finishes frees its slot for the next, whose prefill joins the
        running decodes' next pass (chunked by the budget); after the queue empties the batch drains
        down to the longest output. The decodes read the mean context."""
        pending = list(output_lens)
        heap: list[int] = []  # the decode-step count at which each running request has its last token
        clock = 0  # decode steps every running request has taken so far
        total = 0.0
        decode: dict[int, float] = {}
        mixed: dict[tuple[int, int], float] = {}
        nxt = 0
        while nxt < len(pending) or heap:
            free = self.c - len(heap)
            if free > 0 and nxt < len(pending):
                new = pending[nxt : nxt + free]
                nxt += len(new)
                for chunks in prefill_chunks(len(new), self.isl, self.budget):
                    key = (len(heap), len(chunks))
                    if key not in mixed:
                        step = self.model.step(
                            decode_seqs=len(heap), decode_context=len(heap) * self.context, chunks=chunks
                        )
                        mixed[key] = self._ms(step)
                    total += mixed[key]
                    clock += 1
                    while heap and heap[0] <= clock:
                        heapq.heappop(heap)
                for out in new:  # the prefill gave the first token
                    if out > 1:
                        heapq.heappush(heap, clock + out - 1)
                continue
            steps = heap[0] - clock  # decode until the next request finishes
            total += steps * self._decode_interpolated(len(heap), decode)
            clock += steps
            while heap and heap[0] <= clock:
                heapq.heappop(heap)
        return total

    def _decode_interpolated(self, b: int, cache: dict[int, float]) -> float:
        """``decode_ms(b)``, exact up to 8 and at the grid 8, 12, 16, 24, 32, ... (two points an octave),
        linear between grid points: a drain passes through every batch size, and a decode step's time
        is smooth in it (within 1 % of exact on the anchors' models; tests/perf/test_calibrate.py)."""
        if b <= 8:
            lo = hi = b
        else:
            octave = 1 << (b.bit_length() - 1)
            mid = octave + octave // 2
            lo, hi = (octave, mid) if b < mid else (mid, 2 * octave)
        for point in (lo, hi):
            if point not in cache:
                cache[point] = self.decode_ms(point)
        if lo == hi:
            return cache[lo]
        return cache[lo] + (cache[hi] - cache[lo]) * (b - lo) / (hi - lo)

    def tokens_per_s(
        self, num_requests: int | None, request_rate: float | None, output_lens: Sequence[int] | None = None
    ) -> float:
        """Output tokens/s of a benchmark run.

        Open loop (``request_rate``): ``N`` requests arrive over ``N / rate`` seconds and the last
        one takes its end-to-end latency after that; with a concurrency cap ``c`` (vLLM/SGLang
        ``--max-concurrency`` with a rate) the run takes at least the closed loop's time at ``c``.
        Closed loop with ``N`` requests of identical lengths: they run in waves of ``c`` (a wave's
        sequences start within one prefill ramp and end together, so the last, partial wave takes
        nearly as long as a full one). Without ``N``: the steady state, ``c`` sequences forever.
        ``output_lens`` (a closed loop or offline run whose requests generate different lengths): the
        run as ``queued_run_ms`` serves them, instead of waves of ``osl``.
        """
        if output_lens and request_rate is None:
            return sum(output_lens) / (self.queued_run_ms(output_lens) / 1e3)
        if num_requests is None:
            closed = self.c * self.osl / (self.batch_ms(self.c) / 1e3)
        else:
            full, rest = divmod(num_requests, self.c)
            total_ms = full * self.batch_ms(self.c) + (self.batch_ms(rest) if rest else 0.0)
            closed = num_requests * self.osl / (total_ms / 1e3)
        if request_rate is None:
            return closed
        e2e_s = (self.ttft_ms() + (self.osl - 1) * self.tpot_ms()) / 1e3
        if num_requests is None:
            return min(request_rate * self.osl, self.c / e2e_s * self.osl, closed)
        return min(num_requests * self.osl / (num_requests / request_rate + e2e_s), closed)

    def prefill_capacity_tokens_per_s(self) -> float:
        """Prompt tokens per second the engine prefills while ``c`` sequences decode: passes filled to
        the budget (``budget - c`` prompt tokens each, whole prompts of ``isl``)."""
        room = max(self.budget - self.c, 1)
        whole, rest = divmod(room, self.isl)
        chunks = [(0, self.isl)] * whole + ([(0, rest)] if rest else [])
        step = self._ms(self.model.step(decode_seqs=self.c, decode_context=self.c * self.context, chunks=chunks))
        return room / (step / 1e3) if step > 0 else math.inf


__all__ = ["CommAdjust", "ServingRun"]

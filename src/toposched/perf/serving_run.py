"""One instance under continuous batching with ``c`` sequences running (``ServingRun``): one request's TTFT,
a request's mean TPOT with arriving prompts riding along, and a benchmark run's output tokens/s.

The definitions, and the operating point chosen from them, are in ``perf/serving.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from toposched.perf.latency import PassModel, StepTime, prefill_chunks

CommAdjust = Callable[[float], float]
"""All-reduce milliseconds of a pass -> what the placement pays for them (compression, overlap)."""


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

    def ttft_ms(self) -> float:
        """One prompt's prefill, with the other ``c - 1`` sequences decoding in the same passes."""
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
        return ttft

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

    def tokens_per_s(self, num_requests: int | None, request_rate: float | None) -> float:
        """Output tokens/s of a benchmark run.

        Open loop (``request_rate``): ``N`` requests arrive over ``N / rate`` seconds and the last
        one takes its end-to-end latency after that; with a concurrency cap ``c`` (vLLM/SGLang
        ``--max-concurrency`` with a rate) the run takes at least the closed loop's time at ``c``.
        Closed loop with ``N`` requests of identical lengths: they run in waves of ``c`` (a wave's
        sequences start within one prefill ramp and end together, so the last, partial wave takes
        nearly as long as a full one). Without ``N``: the steady state, ``c`` sequences forever.
        """
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

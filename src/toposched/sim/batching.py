"""Continuous batching of one instance, step by step, after vLLM V1's scheduler (simplified).

Each step (``Batcher.compose``):

1. every running sequence is scheduled in admission order: a decoding one for its next token, a
   partly prefilled one for the next chunk of its prompt, within the step's token budget
   (``max_num_batched_tokens``). Its KV must fit the instance's capacity (prompt + generated
   tokens of every sequence held); when it does not, the newest running sequence is preempted —
   its KV is freed and it goes back to the front of the waiting line, to re-prefill its prompt and
   the tokens it had generated (vLLM's recompute preemption) — until it fits;
2. if nothing was preempted, waiting sequences join in arrival order while the budget, ``batch``
   (``max_num_seqs``) and the KV capacity allow, each with a prefill chunk as large as the budget
   left (chunked prefill). A sequence whose first scheduling comes more than ``timeout_s`` after its
   arrival times out instead.

A sequence that joins holding KV already (a decode instance of a disaggregated deployment receives
the prompt's KV from a prefill instance: ``computed`` = the prompt, one token generated) needs that
KV in the capacity too, and schedules only its next token. A ``prefill_only`` instance hands a
sequence back (``finish`` returns it) as soon as its prompt is prefilled and its first token sampled.

The step takes ``StepCost.step_ms`` of the tokens actually in it. At the end of a step a sequence
whose prompt is all prefilled samples a token (its first token ends its TTFT), a decoding one
samples its next token; a sequence that has all its output tokens leaves and frees its KV.

**Macro steps.** One event per token would cost hundreds of millions of events on a big cluster,
so when a step holds only decodes — then the next steps do too until a sequence finishes, since
nothing in the waiting line can join (no room, or nothing waiting) — ``compose`` jumps ``k`` steps
at once: ``k`` = steps until the first running sequence finishes (or the KV fills), and the
jump's time is ``k x step_ms`` at the mid context of the jump (exact while a decode step's time is
linear in the context, i.e. while it stays memory- or compute-bound throughout). A request that
arrives during a jump and could join the batch interrupts it (``interrupt``): the jump is cut to
the steps completed by then plus the step in flight, after which the batch is recomposed, as a
step-by-step engine would. ``jump=False`` steps one at a time (the tests compare the two).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from toposched.perf.step import StepCost
from toposched.sim.workload import SimRequest


class Batcher:
    """The running and waiting sequences of one instance and the step in flight."""

    def __init__(
        self,
        cost: StepCost,
        *,
        max_seqs: int,
        max_batched_tokens: int,
        kv_capacity: int,
        timeout_s: float,
        jump: bool = True,
        prefill_only: bool = False,
    ) -> None:
        self.cost = cost
        self.prefill_only = prefill_only
        self.max_seqs = max_seqs
        self.budget = max(max_batched_tokens, max_seqs)  # vLLM needs max_num_batched_tokens >= max_num_seqs
        self.kv_capacity = kv_capacity
        self.timeout_s = timeout_s
        self.jump = jump
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.kv_used = 0
        self.busy = False  # a step is in flight
        self.step_start = 0.0
        self.step_end = 0.0
        self.steps = 0  # steps in flight (k of a macro step, else 1)
        self._scheduled: list[tuple[SimRequest, int]] = []
        self._decodes = 0  # macro step: decoding sequences and their total context at its first step
        self._context0 = 0.0
        self.preemptions = 0
        self.steps_done = 0

    @property
    def load(self) -> int:
        """Requests given to this instance and not finished (the router's join-shortest-queue key)."""
        return len(self.running) + len(self.waiting)

    # ------------------------------------------------------------------ composing a step

    def _preempt_newest(self) -> SimRequest:
        victim = self.running.pop()
        self.kv_used -= victim.computed
        victim.computed = 0
        victim.preempted += 1
        victim.state = "waiting"
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def compose(self, now: float, timed_out: Callable[[SimRequest], None]) -> float | None:
        """Start the next step at ``now``; returns its end time, or None when there is nothing to run.

        ``timed_out`` is called for each waiting request that times out instead of starting.
        """
        budget = self.budget
        scheduled: list[tuple[SimRequest, int]] = []
        parts: list[tuple[int, int]] = []  # prefill chunks: (tokens already computed, chunk tokens)
        decodes = 0
        decode_ctx = 0
        to_finish = 1 << 62  # decode steps until the first decoding sequence has all its tokens
        preempted = False
        running = self.running
        capacity = self.kv_capacity
        kv_used = self.kv_used
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            rest = req.input_len + req.generated - req.computed
            n = rest if rest < budget else budget
            if kv_used + n > capacity:
                preempted = True
                self.kv_used = kv_used
                while self.kv_used + n > capacity:
                    if self._preempt_newest() is req:
                        break
                kv_used = self.kv_used
                if i >= len(running):
                    break  # the request itself was preempted
            kv_used += n
            scheduled.append((req, n))
            if rest == 1 and req.generated > 0:
                decodes += 1
                decode_ctx += req.computed
                left = req.output_len - req.generated
                if left < to_finish:
                    to_finish = left
            else:
                parts.append((req.computed, n))
            budget -= n
            i += 1
        self.kv_used = kv_used
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
                req = self.waiting[0]
                if not req.started and now - req.arrival_s > self.timeout_s:
                    self.waiting.popleft()
                    timed_out(req)
                    continue
                n = min(req.input_len + req.generated - req.computed, budget)
                held = req.computed  # KV it brings (a disaggregated decode's prompt); 0 otherwise
                if self.kv_used + held + n > self.kv_capacity:
                    break
                self.waiting.popleft()
                self.running.append(req)
                if not req.started:
                    req.started = True
                    req.start_s = now
                req.state = "running"
                self.kv_used += held + n
                scheduled.append((req, n))
                if held and n == 1 and req.generated > 0:
                    # a decode instance's sequence arrives with its prompt's KV and a first token: its
                    # next token is a decode step like the others' (one query token, the engines' decode
                    # CUDA graphs), not a prefill pass
                    decodes += 1
                    decode_ctx += held
                    to_finish = min(to_finish, req.output_len - req.generated)
                else:
                    parts.append((req.computed, n))  # a joining sequence prefills (its prompt, or all it held)
                budget -= n
        if not scheduled:
            self.busy = False
            return None
        self._scheduled = scheduled
        self.busy = True
        self.step_start = now
        # A step of decodes only repeats until a sequence finishes, unless a waiting request could
        # join (it cannot when the batch is full or nothing waits; a KV-blocked line is stepped one
        # step at a time, since a timed-out head may let a smaller request in).
        if parts or not self.jump or (self.waiting and len(self.running) < self.max_seqs):
            self.steps = 1
            self._decodes = 0
            ms = self.cost.step_ms(decode_seqs=decodes, decode_context=decode_ctx, chunks=parts)
        else:
            kv_steps = (self.kv_capacity - self.kv_used) // decodes + 1  # step 0's tokens are already held
            self.steps = max(1, min(to_finish, kv_steps))
            self._decodes = decodes
            self._context0 = float(decode_ctx)
            ms = self._span_ms(self.steps)
        self.step_end = now + ms / 1000.0
        return self.step_end

    def _span_ms(self, steps: int) -> float:
        """Milliseconds of the first ``steps`` steps of the macro step in flight (mid-context rule)."""
        n = self._decodes
        return steps * self.cost.step_ms(decode_seqs=n, decode_context=self._context0 + n * (steps - 1) / 2)

    def interrupt(self, now: float) -> float | None:
        """A request arrived at ``now`` and may join: cut a macro step to the step in flight.

        Returns the new end of the step in flight, or None when nothing changes (a single step, or
        one ending anyway). A request joins only at a step boundary, as in a step-by-step engine.
        """
        if not self.busy or self.steps <= 1 or self.waiting or len(self.running) >= self.max_seqs:
            return None  # a single step, or the batch is full: the request waits for the step's end
        elapsed_ms = (now - self.step_start) * 1000.0
        lo, hi = 1, self.steps  # smallest m with span(m) > elapsed: the step in flight ends the jump
        while lo < hi:
            mid = (lo + hi) // 2
            if self._span_ms(mid) > elapsed_ms:
                hi = mid
            else:
                lo = mid + 1
        if lo >= self.steps:
            return None
        self.steps = lo
        self.step_end = self.step_start + self._span_ms(lo) / 1000.0
        return self.step_end

    # ------------------------------------------------------------------ finishing a step

    def finish(self, now: float) -> list[SimRequest]:
        """Apply the step(s) in flight at ``now``; returns the requests that finished (KV freed)."""
        self.busy = False
        k = self.steps
        self.steps_done += k
        done: list[SimRequest] = []
        if self._decodes:  # a macro step of decodes: every sequence got k tokens
            self.kv_used += self._decodes * (k - 1)  # the first step's tokens were held at compose
            for req, _ in self._scheduled:
                req.computed += k
                req.generated += k
                if req.generated >= req.output_len:
                    done.append(req)
        else:
            for req, n in self._scheduled:
                req.computed += n
                if req.computed == req.input_len + req.generated:
                    req.generated += 1
                    if self.prefill_only:
                        done.append(req)  # its KV moves to a decode instance, which stamps its first token
                        continue
                    if req.first_token_s < 0:
                        req.first_token_s = now
                    if req.generated >= req.output_len:
                        done.append(req)
        self._scheduled = []
        if done:
            finished = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in finished]
            for req in done:
                self.kv_used -= req.computed
                req.finish_s = now
        return done

    def evict(self) -> list[SimRequest]:
        """Take every request off the instance (it failed): KV lost, the step in flight dropped."""
        out = [*self.running, *self.waiting]
        self.running = []
        self.waiting.clear()
        self.kv_used = 0
        self.busy = False
        self._scheduled = []
        return out

    def unstarted(self) -> list[SimRequest]:
        """Take the waiting requests that never started (a draining instance hands them back)."""
        keep: deque[SimRequest] = deque()
        out: list[SimRequest] = []
        for req in self.waiting:
            (out if not req.started else keep).append(req)
        self.waiting = keep
        return out


__all__ = ["Batcher"]

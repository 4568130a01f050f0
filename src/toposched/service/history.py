"""The nine signals over the last hour, so that the web page's charts have a past when the page opens.

``SignalHistory`` is a ring buffer: one sample of ``metrics.signals`` every ``step_s`` seconds (10 by
default), at most ``window_s / step_s`` samples (an hour: 360), and samples older than the window are
dropped when one is added or read. Its memory is bounded whatever the uptime: a sample is nine values (the
placements-by-TP one a small dict of TP degrees). ``api.sample_forever`` fills it from the service's lifespan;
``GET /v1/signals/history`` (``api.add_history_route``) reads it, behind the same bearer token as ``/v1/alerts``.
This module is the domain side (no HTTP library: tests/service/test_layers.py).

The history lives in one replica's memory: a restart starts it empty, and each replica keeps its own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from toposched.service.metrics import signals
from toposched.service.state import ServiceState

STEP_S = 10.0
"""Seconds between two samples."""
WINDOW_S = 3600.0
"""How far back the history reaches (seconds)."""

SignalValues = dict[str, float | dict[str, float] | None]
"""One sample of the nine signals (``metrics.signals``): the placements-by-TP one a dict of TP degrees."""


@dataclass(frozen=True)
class Sample:
    t: float
    """Unix time of the sample (seconds)."""
    signals: SignalValues


class SignalHistory:
    """The last ``window_s`` of signal samples, one every ``step_s`` (``add`` skips one taken too soon)."""

    def __init__(self, step_s: float = STEP_S, window_s: float = WINDOW_S) -> None:
        if not 0 < step_s <= window_s:
            raise ValueError(f"history step {step_s} s must be over 0 and at most the window ({window_s} s)")
        self.step_s = step_s
        self.window_s = window_s
        self._samples: deque[Sample] = deque(maxlen=int(window_s // step_s) + 1)
        self._lock = threading.Lock()  # added on the state's worker thread, read on the event loop

    def __len__(self) -> int:
        return len(self._samples)

    def due(self, now: float) -> bool:
        """A sample at ``now`` would be kept: none yet, or the last is ``step_s`` old (or from the future)."""
        with self._lock:
            return self._due(now)

    def _due(self, now: float) -> bool:
        if not self._samples:
            return True
        last = self._samples[-1].t
        return now - last >= self.step_s or now < last  # a clock set back starts again from now

    def add(self, now: float, values: SignalValues) -> bool:
        """Keep ``values`` as the sample at ``now`` when one is due; False when it was skipped."""
        with self._lock:
            if not self._due(now):
                return False
            if self._samples and now < self._samples[-1].t:
                self._samples.clear()
            self._samples.append(Sample(now, values))
            self._trim(now)
            return True

    def samples(self, now: float) -> list[Sample]:
        """The samples of the last ``window_s`` before ``now``, oldest first."""
        with self._lock:
            self._trim(now)
            return list(self._samples)

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0].t < now - self.window_s:
            self._samples.popleft()


def take_sample(state: ServiceState, history: SignalHistory, clock: Callable[[], float] = time.time) -> bool:
    """Sample the signals into ``history`` when one is due (runs where the state lives: ``on_worker``)."""
    now = clock()
    if not history.due(now):
        return False
    return history.add(now, signals(state.stats()))

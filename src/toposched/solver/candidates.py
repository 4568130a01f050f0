"""The degree options the scheduler tries for a request (``Candidate``: one option on one GPU type, with
the nodes of that type), their cache key, and the order they are tried in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toposched.solver.options import DegreeOption, OptionSet, Prediction
from toposched.solver.request import PlacementRequest

GOODPUT_NEAR = 0.95
"""Degree options whose goodput per GPU is within this share of the best count as equal
(``option_order``): the fewest GPUs among them wins."""


@dataclass
class Candidate:
    """A degree option on one GPU type with the nodes of that type."""

    options: OptionSet
    option: DegreeOption
    nodes: frozenset[str]


_NOT_OPTION_FIELDS = frozenset(
    {"id", "replicas", "priority", "near", "near_required", "spread_replicas", "allow_cross_domain"}
)
"""Request fields that do not change the degree options (``allow_cross_domain`` only changes where an
option's GPUs may be, not which options there are): left out of ``Scheduler.candidates``' cache key."""
_OPTION_FIELDS = tuple(name for name in PlacementRequest.model_fields if name not in _NOT_OPTION_FIELDS)


def options_key(request: PlacementRequest) -> object:
    """``Scheduler.candidates``' cache key: the repr of every field that can change the degree options.

    A plain ``PlacementRequest`` (every field a str, number, bool, None, tuple or dict, so its value is its
    dump) takes one repr of the values in field order, a third of the cost of a dump and a repr per field
    on every decision; equal keys still mean equal reprs field by field. Subclasses (which may add nested
    models or fields) keep the dump.
    """
    if type(request) is PlacementRequest:
        values = request.__dict__
        return repr([values[name] for name in _OPTION_FIELDS])
    fields = request.model_dump(exclude=set(_NOT_OPTION_FIELDS))
    return tuple((k, repr(v)) for k, v in fields.items())


def option_order(
    prediction: Prediction, request: PlacementRequest, cands: list[Candidate]
) -> Callable[[Candidate], tuple[Any, ...]]:
    """The sort key of the degree options (``layout_key``), with goodput first when it decides.

    When the running batch is the operating point's and there is an SLO, fewer GPUs is not better in
    itself: one GPU at batch 1 may meet a TPOT SLO while serving a tenth of what eight serve per GPU.
    Options that fit as asked then go in order of goodput per GPU at their operating point (over
    the GPU's own link), options within ``GOODPUT_NEAR`` of the best counting as equal (the layout
    key decides among them: fewest GPUs, larger TP)."""
    has_slo = request.slo_tpot_ms is not None or request.slo_ttft_ms is not None
    if prediction != "operating-point" or request.concurrent_seqs is not None or not has_slo:
        return lambda c: layout_key(request, c)
    per_gpu = {
        id(c): c.options.operating(c.option, c.options.gpu.native_link).goodput_tokens_per_s / c.option.gpus
        for c in cands
    }
    best = max(per_gpu.values(), default=0.0)

    def key(c: Candidate) -> tuple[Any, ...]:
        g = per_gpu[id(c)]
        near = best > 0 and g >= GOODPUT_NEAR * best
        return (len(c.option.fallbacks), not near, 0.0 if near else -g, *layout_key(request, c)[1:])

    return key


def layout_key(request: PlacementRequest, cand: Candidate) -> tuple[Any, ...]:
    """The order degree options are tried in (the first placeable one that meets the SLO wins).

    Options that fit as asked come before those needing capacity fallbacks. Then:

    * with a latency SLO (``slo_tpot_ms``/``slo_ttft_ms``): the fewest GPUs, larger TP first;
    * without one, the default layout rule: PP=1 with the smallest TP that fits (TP inside one
      NVLink domain is the better knob: an all-reduce over NVLink costs less than a pipeline
      bubble, and no GPU idles); pipeline stages only when no single TP group can hold the
      model, then the fewest stages with the largest TP (a stage per domain or node). So
      Llama-3.1-405B FP8 on one HGX H100 is TP8, not TP1 x PP7.
    """
    o = cand.option
    if request.slo_tpot_ms is None and request.slo_ttft_ms is None:
        return (len(o.fallbacks), o.pp, o.gpus, -o.tp, cand.options.gpu.name)
    return (len(o.fallbacks), o.gpus, -o.tp, o.pp, cand.options.gpu.name)


__all__ = ["GOODPUT_NEAR", "Candidate", "layout_key", "option_order", "options_key"]

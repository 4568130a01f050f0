"""The simulated requests: seeded draws from the scenario's distributions, or a replayed CSV trace.

A trace is a CSV file with a header; columns (any order, extra columns ignored):

    timestamp    arrival time in seconds from the start (finite, 0 to 10^7)
    input_len    prompt tokens (whole, 1 to 10^6)
    output_len   output tokens (whole, 1 to 10^6)
    slo_class    optional: realtime | interactive | standard | batch (default: the tenant's class)
    tenant       optional: the tenant (deployment) name the request goes to
    model        optional: a tenant's model, when no tenant column is given (must name one tenant)

With one tenant every row goes to it (``model`` is then not checked). docs/simulator.md shows how
to convert a public trace (the Azure LLM inference trace's TIMESTAMP, ContextTokens,
GeneratedTokens columns).
"""

from __future__ import annotations

import csv
import io
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from toposched.errors import InputError
from toposched.inputs import read_text
from toposched.sim.scenario import MAX_REQUESTS, MAX_SECONDS, MAX_TOKENS, SLO_CLASS_NAMES, Lengths, Scenario, Tenant


@dataclass(slots=True, eq=False)
class SimRequest:
    """One inference request and its progress through an instance's continuous batching."""

    id: int
    arrival_s: float
    input_len: int
    output_len: int
    slo_class: str
    tenant: int = 0
    state: str = "new"  # new | queued | waiting | running | done | timed_out | rejected
    computed: int = 0  # tokens whose KV the serving instance holds
    generated: int = 0  # output tokens sampled so far
    started: bool = False  # a prefill chunk has been scheduled at least once
    start_s: float = 0.0  # first scheduled
    first_token_s: float = -1.0
    finish_s: float = 0.0
    instance: str | None = None
    in_domain: bool = False
    tp: int = 0
    requeued: int = 0
    preempted: int = 0
    kv_ms: float = -1.0  # disaggregated: prefill done to KV at the decode instance (waiting for links included)
    kv_wait_ms: float = 0.0  # ... of which waiting for busy links
    kv_scope: str = ""  # same-node | same-rack | cross-rack (the farthest hop)

    @property
    def ttft_s(self) -> float:
        """Arrival to first token (the first attempt's, after a failure requeued the request)."""
        return self.first_token_s - self.arrival_s


def draw_length(rng: random.Random, spec: Lengths) -> int:
    """One draw from ``spec`` (at least 1, at most ``spec.upper``)."""
    if spec.dist == "fixed":
        return spec.mean
    if spec.dist == "uniform":
        lo, hi = spec.mean * (1 - spec.spread), spec.mean * (1 + spec.spread)
        return max(1, round(rng.uniform(lo, hi)))
    mu = math.log(spec.mean) - spec.sigma * spec.sigma / 2  # so that the mean of the draws is ``mean``
    return max(1, min(spec.upper, round(rng.lognormvariate(mu, spec.sigma))))


def draw_request(rng: random.Random, tenant: Tenant, index: int, id_: int, arrival_s: float) -> SimRequest:
    """A request of ``tenant`` (number ``index``) arriving at ``arrival_s``, lengths and class drawn."""
    if tenant.slo_mix:
        classes = list(tenant.slo_mix)
        slo_class = rng.choices(classes, [tenant.slo_mix[c] for c in classes])[0]
    else:
        slo_class = tenant.slo_class
    return SimRequest(
        id=id_,
        arrival_s=arrival_s,
        input_len=draw_length(rng, tenant.input_len),
        output_len=draw_length(rng, tenant.output_len),
        slo_class=slo_class,
        tenant=index,
    )


def make_arrivals(scenario: Scenario, seed: int) -> list[SimRequest]:
    """The requests of a run known before it starts: a trace, or seeded Poisson / bursty arrivals.

    Churn scenarios without a trace return an empty list: their requests are drawn while the run
    goes, one stream per instance that is up.
    """
    tenants = scenario.tenant_list()
    if scenario.trace:
        return read_trace(scenario.trace, tenants)
    if scenario.churn is not None:
        return []
    rng = random.Random(seed)
    weights = [t.weight for t in tenants]
    a = scenario.arrivals
    out: list[SimRequest] = []
    t = 0.0
    for i in range(scenario.request_count):
        rate = a.rate_per_s
        if a.kind == "bursty" and (t % a.burst_every_s) < a.burst_length_s:
            rate *= a.burst_factor
        t += rng.expovariate(rate)
        k = 0 if len(tenants) == 1 else rng.choices(range(len(tenants)), weights)[0]
        out.append(draw_request(rng, tenants[k], k, i, t))
    return out


TRACE_COLUMNS = ("timestamp", "input_len", "output_len")
OPTIONAL_COLUMNS = ("slo_class", "tenant", "model")


def _value(row: list[str], at: int | None) -> str | None:
    if at is None or at >= len(row):
        return None
    return row[at].strip() or None


def _tenant_of(row: list[str], column: dict[str, int | None], tenants: Sequence[Tenant], where: str) -> int:
    if len(tenants) <= 1:
        return 0
    name = _value(row, column["tenant"])
    if name is not None:
        for k, tenant in enumerate(tenants):
            if tenant.name == name:
                return k
        raise InputError(f"{where}: tenant {name[:40]!r} is not one of {', '.join(t.name for t in tenants)}")
    model = _value(row, column["model"])
    matches = [k for k, t in enumerate(tenants) if model is not None and t.model == model]
    if len(matches) == 1:
        return matches[0]
    if model is None:
        raise InputError(f"{where}: no tenant or model value, and the scenario has {len(tenants)} tenants")
    raise InputError(
        f"{where}: model {model[:40]!r} names {len(matches)} tenants", fix="add a tenant column naming the tenant"
    )


_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?", re.ASCII)
"""A timestamp as a CSV holds it: ``12``, ``0.25``, ``1.5e3`` (no underscores, no NaN, no other digits)."""


def _trace_row(
    row: list[str], column: dict[str, int | None], where: str, id_: int, tenants: Sequence[Tenant]
) -> SimRequest:
    """One CSV row as a request; InputError naming the file, line and column otherwise."""
    values: dict[str, str] = {}
    for name in TRACE_COLUMNS:
        value = _value(row, column[name])
        if value is None:
            raise InputError(f"{where}: no value in column {name!r}", fix="give every column a value")
        values[name] = value
    stamp = values["timestamp"]
    try:  # plain decimal or exponent notation in ASCII: float() would also take '1_0' and other scripts' digits
        if not _NUMBER.fullmatch(stamp):
            raise ValueError(stamp)
        arrival = float(stamp)
    except ValueError:
        raise InputError(f"{where}: timestamp {stamp[:40]!r} is not a number of seconds") from None
    if not (math.isfinite(arrival) and 0 <= arrival <= MAX_SECONDS):
        raise InputError(f"{where}: timestamp {values['timestamp'][:40]!r} must be from 0 to {MAX_SECONDS:g} s")
    lengths = []
    for name in ("input_len", "output_len"):
        text = values[name]
        if not (text.isascii() and text.isdigit() and len(text) <= 7 and 1 <= int(text) <= MAX_TOKENS):
            raise InputError(f"{where}: {name} {text[:40]!r} must be a whole number from 1 to {MAX_TOKENS:,}")
        lengths.append(int(text))
    tenant = _tenant_of(row, column, tenants, where)
    slo = _value(row, column["slo_class"])
    if column["slo_class"] is not None and slo is None:
        raise InputError(f"{where}: no value in column 'slo_class'", fix="give every column a value")
    if slo is not None and slo not in SLO_CLASS_NAMES:
        raise InputError(f"{where}: slo_class {slo[:40]!r} is not one of {', '.join(SLO_CLASS_NAMES)}")
    default_class = tenants[tenant].slo_class if tenants else "interactive"
    return SimRequest(
        id=id_,
        arrival_s=arrival,
        input_len=lengths[0],
        output_len=lengths[1],
        slo_class=slo or default_class,
        tenant=tenant,
    )


def read_trace(path: str, tenants: Sequence[Tenant] = ()) -> list[SimRequest]:
    """Requests from a CSV trace (see the module docstring), sorted by arrival.

    Read through ``toposched.inputs`` (a bounded regular UTF-8 file); at most ``MAX_REQUESTS``
    rows; every value is checked (finite timestamps, whole token counts, known SLO classes and
    tenants) and a bad row is one InputError naming the file and the line.
    """
    if not path or "\x00" in path:
        raise InputError(f"trace {path[:60]!r} is not a path", fix="name a CSV file")
    text = read_text(path, what="trace")
    reader = csv.reader(io.StringIO(text, newline=""))
    out: list[SimRequest] = []
    try:
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in TRACE_COLUMNS if c not in header]
        if missing:
            raise InputError(
                f"trace {path}: missing column(s) {', '.join(sorted(missing))}",
                fix="the header needs timestamp,input_len,output_len (slo_class, tenant, model optional)",
            )
        column: dict[str, int | None] = {name: header.index(name) for name in TRACE_COLUMNS}
        column.update({name: header.index(name) if name in header else None for name in OPTIONAL_COLUMNS})
        for row in reader:
            if not row or not any(cell.strip() for cell in row):
                continue  # blank lines
            if len(out) >= MAX_REQUESTS:
                raise InputError(f"trace {path}: more than {MAX_REQUESTS:,} requests", fix="split the trace")
            out.append(_trace_row(row, column, f"trace {path}, line {reader.line_num}", len(out), tenants))
    except csv.Error as exc:
        raise InputError(f"trace {path}, line {reader.line_num}: not valid CSV: {exc}") from None
    if not out:
        raise InputError(f"trace {path}: no requests", fix="add rows after the header")
    out.sort(key=lambda r: (r.arrival_s, r.id))
    for position, req in enumerate(out):
        req.id = position  # ids follow arrival order (the simulator indexes requests by id)
    return out


__all__ = ["SimRequest", "draw_length", "draw_request", "make_arrivals", "read_trace"]

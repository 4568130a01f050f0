"""The plots of ``simulate --out`` (issue 38): the data behind each, the figures' axes, the files written."""

from __future__ import annotations

import bisect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from toposched.sim.builtin_scenarios import SCENARIOS
from toposched.sim.engine import Simulation
from toposched.sim.loading import load_cluster
from toposched.sim.metrics import MAX_OCCUPANCY_SAMPLES, DomainOccupancy, DomainSampler, compute, pct, per_token_ms
from toposched.sim.run import PolicyResult, deployments_for, make_arrivals, run_policy
from toposched.sim.scenario import Arrivals, Lengths, Scenario, Tenant
from toposched.solver.index import ClusterIndex
from toposched.solver.scheduler import Scheduler

plt = pytest.importorskip("matplotlib.pyplot")

from toposched.sim import plots  # noqa: E402  (after the skip: plots need matplotlib)
from toposched.sim.report import write_report  # noqa: E402

TWO_TENANTS = Scenario(
    name="two-tenants",
    cluster="2xhgx-h100",
    tenants=(
        Tenant(name="chat", model="llama-3.1-8b", tp=1, batch=8, weight=3, slo_factor=1.25,
               input_len=Lengths(dist="uniform", mean=256), output_len=Lengths(dist="uniform", mean=32)),
        Tenant(name="big", model="llama-3.1-70b", tp=4, batch=8, weight=1, slo_factor=1.0,
               input_len=Lengths(dist="uniform", mean=256), output_len=Lengths(dist="uniform", mean=32)),
    ),
    requests=160,
    arrivals=Arrivals(rate_per_s=80.0),
)  # fmt: skip


def _copy(*refs: str) -> Any:
    """A stand-in copy: the sampler reads only ``placement.gpu_refs``."""
    return SimpleNamespace(placement=SimpleNamespace(gpu_refs=refs))


def _result(name: str, tenants: dict[str, dict[str, Any]], **values: Any) -> PolicyResult:
    return PolicyResult(name, {"tenants": tenants}, values.pop("per_token_ms", []), [], 0.0, 0, **values)


# --------------------------------------------------------------------------- domain occupancy


def test_sampler_counts_the_gpus_each_domain_holds() -> None:
    sampler = DomainSampler.of(ClusterIndex(load_cluster("2xhgx-h100")))
    assert sampler.rows == ("hgx-h100-0/nv0", "hgx-h100-1/nv0") and sampler.sizes == (8, 8)
    sampler.sample(0.0, {})
    sampler.sample(1.0, {"a": _copy("hgx-h100-0/0", "hgx-h100-0/1"), "b": _copy("hgx-h100-1/7")})
    sampler.sample(2.0, {"b": _copy("hgx-h100-1/7"), "c": _copy(*(f"hgx-h100-0/{i}" for i in range(4, 8)))})
    assert sampler.times == [0.0, 1.0, 2.0]
    assert sampler.held == [(0, 0), (2, 1), (4, 1)]
    occupancy = sampler.result(end_s=3.0)
    assert occupancy.shares() == [[0.0, 0.25, 0.5], [0.0, 0.125, 0.125]]


def test_gpus_in_no_domain_get_a_row_per_node() -> None:
    cluster = load_cluster("mixed-gb200-h100-l40s")
    sampler = DomainSampler.of(ClusterIndex(cluster))
    pcie = [(row, size) for row, size in zip(sampler.rows, sampler.sizes, strict=True) if "(no NVLink)" in row]
    assert [row for row, _ in pcie] == [f"{n.name} (no NVLink)" for n in cluster.nodes if n.name.startswith("l40s")]
    assert sum(size for _, size in pcie) == 32 and sum(sampler.sizes) == sum(len(n.gpus) for n in cluster.nodes)
    assert sampler.rows[0] == "gb200/clique0" and sampler.sizes[0] == 36


def test_sampler_memory_is_bounded_and_samples_stay_evenly_spread() -> None:
    sampler = DomainSampler.of(ClusterIndex(load_cluster("2xhgx-h100")), limit=8)
    for call in range(100):
        sampler.sample(float(call), {})
    assert 4 <= len(sampler.times) <= 8 and sampler.stride == 16
    gaps = {b - a for a, b in zip(sampler.times, sampler.times[1:], strict=False)}
    assert sampler.times[0] == 0.0 and gaps == {16.0}


def test_a_run_samples_what_the_gpu_series_says_is_held() -> None:
    """Every sample's GPUs summed over domains = GPUs held just before that time (``gpu_series``)."""
    result = run_policy(SCENARIOS.get("churn-tiny"), "slo", seed=0)
    occupancy = result.occupancy
    assert occupancy is not None and occupancy.end_s == 120.0
    assert 100 <= len(occupancy.times) <= MAX_OCCUPANCY_SAMPLES
    change_times = [s[0] for s in result.gpu_series]
    checked = 0
    for time, held in zip(occupancy.times, occupancy.held, strict=True):
        if time > 0:
            before = result.gpu_series[bisect.bisect_left(change_times, time) - 1]
            assert sum(held) == before[1], time
            checked += 1
    assert checked > 100 and max(sum(h) for h in occupancy.held) > 8  # both domains were used


def test_pooled_rows_keep_the_share_of_the_pool() -> None:
    occupancy = DomainOccupancy(
        rows=tuple(f"d{k}" for k in range(100)),
        sizes=(8,) * 99 + (4,),
        times=(0.0, 5.0),
        held=((8,) * 99 + (4,), tuple(k % 3 for k in range(100))),
        end_s=10.0,
    )
    labels, shares = plots.pooled(occupancy, max_rows=48)
    assert len(labels) == 34 and labels[0] == "1-3" and labels[-1] == "100-100"
    assert shares[0] == [1.0, (0 + 1 + 2) / 24] and shares[-1] == [1.0, (99 % 3) / 4]
    same, _ = plots.pooled(occupancy, max_rows=100)
    assert same == list(occupancy.rows)


def test_heat_map_has_a_panel_per_policy_with_the_shares() -> None:
    two = DomainOccupancy(("a", "b"), (8, 8), (0.0, 1.0, 2.0), ((8, 0), (4, 2), (0, 8)), end_s=3.0)
    results = {"slo": _result("slo", {}, occupancy=two), "random": _result("random", {}, occupancy=two)}
    fig = plots.domain_occupancy_figure(results)
    assert fig is not None
    try:
        panels = [ax for ax in fig.axes if ax.get_title()]
        assert [ax.get_title().split(":")[0] for ax in panels] == ["slo", "random"]
        mesh = panels[0].collections[0]
        assert mesh.get_array().reshape(2, 3).tolist() == [[1.0, 0.5, 0.0], [0.0, 0.25, 1.0]]
        assert mesh.get_clim() == (0.0, 1.0)
        assert [t.get_text() for t in panels[0].get_yticklabels()] == ["a", "b"]
        assert panels[0].get_xlim() == (0.0, 3.0)
    finally:
        plt.close(fig)
    assert plots.domain_occupancy_figure({"slo": _result("slo", {})}) is None


# --------------------------------------------------------------------------- SLO met per tenant


def test_tenant_attainment_is_met_over_all_requests_of_the_tenant() -> None:
    """By hand from the run's requests: done within the tenant's SLO / all its requests."""
    scheduler = Scheduler(load_cluster(TWO_TENANTS.cluster), prediction="design-batch")
    deps = deployments_for(TWO_TENANTS, scheduler)
    sim = Simulation(TWO_TENANTS, scheduler, deps, "slo", 0)
    sim.run(make_arrivals(TWO_TENANTS, 0))
    expected = {}
    for dep in deps:
        mine = [r for r in sim.requests if r.tenant == dep.index]
        met = [r for r in mine if r.state == "done" and per_token_ms(r) <= dep.slo_ms]
        expected[dep.tenant.name] = {"slo": round(len(met) / len(mine), 4)}
    table = plots.tenant_attainment({"slo": PolicyResult("slo", compute(sim), [], [], 0.0, 0)})
    assert table == expected
    assert 0 < expected["big"]["slo"] < expected["chat"]["slo"] <= 1  # a tight SLO: not all met


def test_tenant_bars_are_grouped_by_tenant_with_value_labels() -> None:
    tenants = {"chat": {"tp": 1, "slo_ms": 15.0}, "big": {"tp": 4, "slo_ms": 40.0}}
    results = {
        name: _result(name, {t: {**info, "slo_attainment": values[k]} for k, (t, info) in enumerate(tenants.items())})
        for name, values in {"slo": (0.9995, 0.8), "random": (0.5, None)}.items()
    }
    assert plots.tenant_attainment(results) == {
        "chat": {"slo": 0.9995, "random": 0.5},
        "big": {"slo": 0.8, "random": None},
    }
    fig = plots.tenant_slo_figure(results)
    try:
        ax = fig.axes[0]
        heights = [round(p.get_height(), 4) for p in ax.patches]
        assert heights == [0.9995, 0.8, 0.5, 0.0]  # policy by policy, tenants in order
        centres = [p.get_x() + p.get_width() / 2 for p in ax.patches]
        assert centres[0] < centres[2] < 0.5 < centres[1] < centres[3]  # each tenant's bars side by side
        labels = [t.get_text() for t in ax.texts]
        assert labels == [">99.9%", "80.0%", "50.0%", "n/a"]
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            "chat\nTP1, SLO 15 ms/token",
            "big\nTP4, SLO 40 ms/token",
        ]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["slo", "random"]
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- latency CDFs


def test_latency_cdfs_are_log_scale_with_p50_and_p99_on_each_curve() -> None:
    fast = [10.0 + k for k in range(100)]
    slow = [10.0 * k for k in range(1, 201)]
    results = {
        "slo": _result("slo", {"t": {"slo_ms": 50.0}}, per_token_ms=fast, ttft_ms=fast, tpot_ms=fast),
        "random": _result("random", {"t": {"slo_ms": 50.0}}, per_token_ms=slow, ttft_ms=slow, tpot_ms=[]),
    }
    fig = plots.latency_cdf_figure(results)
    try:
        axes = fig.axes
        assert [ax.get_xlabel() for ax in axes] == ["per-token latency (ms)", "TTFT (ms)", "TPOT (ms)"]
        assert all(ax.get_xscale() == "log" for ax in axes)
        points = {
            (line.get_marker(), line.get_color()): (line.get_xdata()[0], line.get_ydata()[0])
            for line in axes[0].get_lines()
            if len(line.get_xdata()) == 1
        }
        curves = {line.get_label().split(":")[0]: line for line in axes[0].get_lines() if len(line.get_xdata()) > 2}
        for name, values in (("slo", fast), ("random", slow)):
            colour = curves[name].get_color()
            assert points[("o", colour)] == (pct(values, 0.5), 0.5)
            assert points[("^", colour)] == (pct(values, 0.99), 0.99)
        assert curves["random"].get_label() == "random: p50 1,000, p99 1,980"
        assert [line.get_xdata()[0] for line in axes[0].get_lines() if line.get_linestyle() == "--"] == [50.0]
        assert len([line for line in axes[2].get_lines() if len(line.get_xdata()) > 2]) == 1  # random has no TPOT
        legend = [t.get_text() for t in axes[1].get_legend().get_texts()]
        assert legend[-2:] == ["p50", "p99"]
    finally:
        plt.close(fig)


def test_ms_labels_read_as_plain_numbers() -> None:
    assert [plots.ms(v) for v in (9.56, 42.0, 368.4, 24667.2, 86660.0)] == ["9.56", "42", "368", "24,667", "86,660"]


# --------------------------------------------------------------------------- files


def test_report_writes_each_plot_as_a_png_and_embeds_it(tmp_path: Path) -> None:
    from PIL import Image

    scenario = SCENARIOS.get("churn-tiny")
    results = {p: run_policy(scenario, p, seed=0) for p in ("slo", "random")}
    written = write_report(tmp_path, scenario, 0, results)
    pngs = [p for p in written if p.suffix == ".png"]
    assert [p.name for p in pngs] == list(plots.CAPTIONS)
    for path in pngs:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            width, height = image.size
            assert image.format == "PNG" and 600 <= width <= 2500 and 300 <= height <= 2500, (path.name, image.size)
    md = (tmp_path / "report.md").read_text()
    page = (tmp_path / "report.html").read_text()
    for name, caption in plots.CAPTIONS.items():
        assert f"{caption}\n\n![{name}]({name})" in md
        assert f"<img src='{name}'>" in page

"""The loop's outputs: Prometheus series, the webhook, NVML errors; and the service's reaction."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, ClassVar

import pytest

from tests.sidecar.conftest import HGX_REFS, Scenario, place
from toposched.sidecar.checks import Alert, expectations_from_plan
from toposched.sidecar.fake_scenarios import build_scenario
from toposched.sidecar.loop import LoopConfig, Report, Sidecar
from toposched.sidecar.react import react
from toposched.solver.request import PlacementRequest


def _run(scenario: Scenario, name: str, **kw: Any) -> tuple[Sidecar, list[dict[str, Any]], list[dict[str, Any]]]:
    fake, exp, _ = scenario(name)
    out: list[dict[str, Any]] = []
    err: list[dict[str, Any]] = []
    sidecar = Sidecar(
        fake,
        exp,
        config=LoopConfig(iterations=4, **kw),
        before_cycle=fake.advance,
        emit=out.append,
        emit_error=err.append,
        sleep=lambda _s: None,
    )
    sidecar.run()
    return sidecar, out, err


def test_metrics(scenario: Scenario) -> None:
    sidecar, _, _ = _run(scenario, "traffic-ramp")
    text = sidecar.metrics.text()
    assert "toposched_sidecar_checks_total 4.0" in text
    assert 'toposched_sidecar_alerts_total{kind="PCIE_BUDGET_WARNING"} 2.0' in text
    assert 'toposched_sidecar_alerts_total{kind="HBM_DRIFT"} 0.0' in text
    assert 'toposched_sidecar_active_alerts{kind="PCIE_BUDGET_WARNING"} 2.0' in text
    assert "toposched_sidecar_check_cpu_seconds " in text
    # 110% of 16 GB/s at cycle 3, in bytes per second (Prometheus' base units)
    pcie = sidecar.metrics.registry.get_sample_value("toposched_sidecar_pcie_bytes_per_second", {"gpu": "hgx-h100/0"})
    assert pcie == pytest.approx(17.6e9)
    assert "_gbps" not in text and "_ms" not in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert all(n.startswith("toposched_sidecar_") for n in names)


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[str]:
    _Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/alerts"
    server.shutdown()
    server.server_close()


def test_webhook_gets_each_report(scenario: Scenario, webhook: str) -> None:
    _, _, err = _run(scenario, "link-down", webhook=webhook)
    assert err == []
    assert len(_Hook.received) == 1
    report = _Hook.received[0]
    assert report["cycle"] == 2 and {a["kind"] for a in report["new_alerts"]} == {"TOPOLOGY_DRIFT"}
    assert {a["gpu"] for a in report["new_alerts"]} == {"hgx-h100/1"}


def test_webhook_failure_is_logged_not_fatal(scenario: Scenario) -> None:
    sidecar, _, err = _run(scenario, "hbm-leak", webhook="http://127.0.0.1:9/none", webhook_timeout_s=0.5)
    assert len(sidecar.reports) == 1
    assert len(err) == 1 and err[0]["event"] == "error" and "webhook" in err[0]["message"]


def test_nvml_error_cycle_goes_on(scenario: Scenario) -> None:
    fake, exp, _ = scenario("steady")
    err: list[dict[str, Any]] = []
    sidecar = Sidecar(fake, exp, emit=lambda _e: None, emit_error=err.append, before_cycle=fake.advance)
    fake.nvmlShutdown()
    result = sidecar.cycle(0)
    assert result.errors and err[0]["event"] == "error"
    fake.nvmlInit()
    assert sidecar.cycle(1).errors == ()


def test_reaction_degrades_and_proposes_other_gpus() -> None:
    scheduler, placement = place("hgx-h100", tp=4)
    request = PlacementRequest(model="llama-3.1-8b", allowed_tp=(4,), id="inst")
    drift = Alert("TOPOLOGY_DRIFT", "hgx-h100/1", "nvlink->0", 0, 18, "lost")
    report = Report(placement.id, "hgx-h100", 2, (drift,), (drift,), 0.0)
    free_before = set(scheduler.index.free)
    accounts_before = scheduler.ledger.accounts()
    reaction = react(report, scheduler, placement, request)
    assert reaction.status == "degraded" and reaction.drifted_gpus == ("hgx-h100/1",)
    assert reaction.proposal is not None
    assert set(reaction.proposal.gpu_refs) == set(HGX_REFS[4:])  # the only other TP=4 NVLink group
    assert scheduler.index.free == free_before and scheduler.ledger.accounts() == accounts_before  # nothing committed
    assert reaction.to_json()["proposal"]["gpus"] == list(reaction.proposal.gpu_refs)


def test_reaction_without_room_says_why() -> None:
    scheduler, placement = place("hgx-h100", tp=4)
    request = PlacementRequest(model="llama-3.1-8b", allowed_tp=(4,), id="inst")
    scheduler.place(PlacementRequest(model="llama-3.1-8b", allowed_tp=(4,), id="other"))
    drift = Alert("HBM_DRIFT", "hgx-h100/0", "hbm", 2.0, 1.0, "over")
    reaction = react(Report(placement.id, "hgx-h100", 0, (drift,), (drift,), 0.0), scheduler, placement, request)
    assert reaction.status == "degraded" and reaction.proposal is None and reaction.reasons


def test_reaction_excludes_drifted_free_gpus() -> None:
    scheduler, placement = place("hgx-h100", tp=4)
    scheduler.release(placement.id)
    request = PlacementRequest(model="llama-3.1-8b", allowed_tp=(4,), id="inst")
    drift = Alert("TOPOLOGY_DRIFT", "hgx-h100/1", "nvlink->0", 0, 18, "lost")
    reaction = react(Report(placement.id, "hgx-h100", 0, (drift,), (drift,), 0.0), scheduler, placement, request)
    assert reaction.proposal is not None and "hgx-h100/1" not in reaction.proposal.gpu_refs
    assert "hgx-h100/1" in scheduler.index.free


def test_no_alerts_no_reaction() -> None:
    scheduler, placement = place("hgx-h100", tp=4)
    request = PlacementRequest(model="llama-3.1-8b", allowed_tp=(4,), id="inst")
    reaction = react(Report(placement.id, "hgx-h100", 0, (), (), 0.0), scheduler, placement, request)
    assert reaction.status == "ok" and reaction.proposal is None


def test_budget_from_plan_cross_domain_traffic() -> None:
    scheduler, placement = place("hgx-h100", tp=4)
    moved = placement.model_copy(update={"cross_domain_gbps": 40.0})
    exp = expectations_from_plan(moved, scheduler.cluster)
    assert {g.pcie_budget_gbps for g in exp.gpus} == {10.0}
    fake = build_scenario("steady", scheduler.cluster.nodes[0], exp)
    assert fake.interval_s == 10.0

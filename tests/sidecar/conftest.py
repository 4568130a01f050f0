"""Builders for sidecar tests: a placement on a preset, its expectations, a scripted NVML."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from toposched.sidecar.checks import Expectations, expectations_from_plan
from toposched.sidecar.fake_scenarios import ScriptedNvml, build_scenario
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.model import Cluster
from toposched.topology.presets import load_preset


def place(preset: str = "hgx-h100", tp: int = 4, model: str = "llama-3.1-8b") -> tuple[Scheduler, Placement]:
    scheduler = Scheduler(load_preset(preset))
    request = PlacementRequest(model=model, allowed_tp=(tp,), id="inst")
    outcome = scheduler.place(request)
    assert outcome.placements, outcome.unplaced
    return scheduler, outcome.placements[0]


Scenario = Callable[[str], tuple[ScriptedNvml, Expectations, Cluster]]


@pytest.fixture
def scenario() -> Scenario:
    def make(name: str, preset: str = "hgx-h100", tp: int = 4) -> tuple[ScriptedNvml, Expectations, Cluster]:
        scheduler, placement = place(preset, tp)
        exp = expectations_from_plan(placement, scheduler.cluster)
        fake = build_scenario(name, scheduler.cluster.node(exp.node), exp)
        fake.nvmlInit()
        return fake, exp, scheduler.cluster

    return make


HGX_REFS = tuple(f"hgx-h100/{i}" for i in range(8))

"""The terminal table: one row per policy when it fits, transposed on an 80-column terminal."""

from __future__ import annotations

from rich.console import Console

from toposched.sim.loading import load_scenario
from toposched.sim.report import TABLE_COLUMNS, result_table
from toposched.sim.run import run_policy


def _render(width: int) -> str:
    scenario = load_scenario("small").model_copy(update={"requests": 60})
    results = {p: run_policy(scenario, p) for p in ("index-order", "random", "slo")}
    console = Console(width=width, record=True, color_system=None)
    console.print(result_table(scenario, results, width))
    return console.export_text()


def test_a_narrow_terminal_gets_whole_numbers_and_whole_names() -> None:
    narrow = _render(80)
    assert "…" not in narrow and all(len(line) <= 80 for line in narrow.splitlines())
    assert "index-order" in narrow and "SLO met" in narrow
    wide = _render(200)
    header = next(line for line in wide.splitlines() if "policy" in line)
    assert header.count("┃") == len(TABLE_COLUMNS) + 2  # one column per metric
    assert "…" not in wide


def test_the_report_says_per_tenant_why_instances_waited() -> None:
    """Issue 35: the run's report names, per tenant and policy, what its instances waited for."""
    from toposched.sim.report import tenant_lines

    scenario = load_scenario("churn-tiny")
    results = {p: run_policy(scenario, p, seed=0) for p in ("slo", "index-order")}
    lines = tenant_lines(results)
    assert lines[0] == "tenant small-tp1 (TP=1):" and "tenant big-tp4 (TP=4):" in lines
    big = results["slo"].metrics["tenants"]["big-tp4"]
    assert big["instance_arrivals"] == results["index-order"].metrics["tenants"]["big-tp4"]["instance_arrivals"] > 0
    line = next(x for x in lines[lines.index("tenant big-tp4 (TP=4):") :] if x.startswith("  slo:"))
    assert f"{big['instance_arrivals']} instances, {big['held_for_headroom']} held for headroom" in line
    assert f"{big['never_placed']} never placed" in line
    one = load_scenario("small").model_copy(update={"requests": 20})
    assert tenant_lines({"slo": run_policy(one, "slo")}) == []  # one tenant: the table says it all

"""A broken internal invariant is an ``InvariantError`` (a bug to report), not a bare assertion."""

from __future__ import annotations

import pytest

from toposched.errors import InputError, InvariantError, StateError, ToposchedError
from toposched.sim import run as sim_run
from toposched.sim.scenario import Arrivals, Lengths, Scenario

TINY = Scenario(
    name="t",
    cluster="2xhgx-h100",
    model="llama-3.1-8b",
    requests=10,
    arrivals=Arrivals(rate_per_s=30.0),
    input_len=Lengths(mean=64, dist="uniform"),
    output_len=Lengths(mean=8, dist="uniform"),
)


def test_broken_conservation_is_an_invariant_error_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_run, "check_conservation", lambda sim: ["3 requests neither done nor running"])
    with pytest.raises(InvariantError, match="conservation broken in policy slo: 3 requests") as caught:
        sim_run.run_policy(TINY, "slo", seed=0)
    error = caught.value
    assert not isinstance(error, (InputError, StateError)) and isinstance(error, ToposchedError)
    assert error.exit_code == 70 and error.fix is not None and "bug" in error.fix


def test_a_run_that_conserves_raises_nothing() -> None:
    assert sim_run.run_policy(TINY, "slo", seed=0).metrics["completed"] == 10

"""A max model len above the model's context is refused when the request meets the model (issue 14 item 10)."""

from __future__ import annotations

import pytest

from tests.conftest import RunCli
from toposched.errors import InfeasibleError
from toposched.solver.options import context_limit
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import load_preset
from toposched.workload import catalog, resolve_model


def test_the_limit_is_the_models_derived_max_len() -> None:
    # vLLM does not scale max_position_embeddings again for llama3 / yarn rope scaling (config/model.py)
    assert context_limit(resolve_model("llama-3.1-70b")) == 131072
    assert context_limit(resolve_model("deepseek-v3")) == 163840
    assert context_limit(resolve_model("llama-3-70b")) == 8192
    assert all(context_limit(spec) == spec.max_position_embeddings for spec in catalog().values())


def test_the_scheduler_refuses_a_longer_context_naming_the_limit() -> None:
    scheduler = Scheduler(load_preset("hgx-h100"))
    with pytest.raises(InfeasibleError, match="max_model_len 200000 is longer than the 131072-token context") as err:
        scheduler.place(PlacementRequest(model="llama-3.1-70b", max_model_len=200_000))
    assert err.value.fix == "use --max-model-len 131072 or less"
    assert not scheduler.placements  # nothing booked
    # the limit itself is a valid request
    at_limit = PlacementRequest(id="at-limit", model="llama-3.1-8b", max_model_len=131_072, concurrent_seqs=1)
    assert scheduler.place(at_limit).placements


def test_plan_cli_refuses_it_in_one_line(run_cli: RunCli) -> None:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-70b", "--max-model-len", "200000", "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: max_model_len 200000 is longer than the 131072-token context of llama-3.1-70b "
        "(max_position_embeddings in its config.json); vLLM and SGLang refuse to start with it",
        "  fix: use --max-model-len 131072 or less",
    ]
    launch = run_cli("launch", "vllm", "--preset", "hgx-h100", "--model", "llama-3-8b", "--max-model-len", "8193")
    assert launch.exit_code == 2 and "8192-token context of llama-3-8b" in launch.stderr

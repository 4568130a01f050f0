"""Plans sized for goodput (solver/sizing.py, solver/place.py): operating points, verdicts, capacity."""

from __future__ import annotations

import math

import pytest

from toposched.errors import InputError
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.solver.sizing import size_for_rate, slo_remedies
from toposched.topology.presets import hgx_h100_cluster, load_preset


def _req(**kw: object) -> PlacementRequest:
    return PlacementRequest(id="r", model="llama-3.1-70b", **kw)  # type: ignore[arg-type]


def test_each_placement_runs_at_its_operating_point() -> None:
    s = Scheduler(load_preset("hgx-h100"))
    (p,) = s.place(_req(allowed_tp=(4,), slo_tpot_ms=40)).placements
    (fixed,) = (
        Scheduler(load_preset("hgx-h100")).place(_req(allowed_tp=(4,), slo_tpot_ms=40, concurrent_seqs=8)).placements
    )
    assert p.max_num_seqs is not None and p.max_num_seqs > 8 and p.operating_limit == "slo-tpot"
    assert fixed.max_num_seqs == 8 and fixed.operating_limit == "fixed"
    assert p.goodput_tokens_per_s is not None and fixed.goodput_tokens_per_s is not None
    # issue 32's target was 4x at the planned rates; with the profile refitted on the vLLM/SGLang rows too
    # (issue 34) the model gives 3.9x (docs/solver.md): a plan sized for goodput still serves several times more
    assert p.goodput_tokens_per_s >= 3.5 * fixed.goodput_tokens_per_s
    assert p.tpot_ms <= 40 and p.check("slo").held
    # the batch fits the KV cache at the workload's lengths
    assert p.max_num_seqs * math.ceil((1024 + 256) / 16) * 16 <= p.kv_tokens_capacity


def test_an_option_is_chosen_for_goodput_per_gpu_not_fewest_gpus() -> None:
    """Mixtral-8x22B meets a 40 ms TPOT on five GPUs at batch 1 (pipeline stages), but eight serve far more."""
    (p,) = Scheduler(load_preset("hgx-h100")).place(PlacementRequest(model="mixtral-8x22b", slo_tpot_ms=40)).placements
    assert (p.tp, p.pp) == (8, 1) and p.max_num_seqs is not None and p.max_num_seqs > 32


def test_a_required_slo_that_is_missed_is_not_placed_and_says_what_would_meet_it() -> None:
    s = Scheduler(load_preset("hgx-h200"))
    out = s.place(PlacementRequest(model="llama-3.1-405b", slo_tpot_ms=30, slo_required=True))
    assert out.placements == [] and out.unplaced[0].status == "rejected"
    reasons = " ".join(out.unplaced[0].reasons)
    assert "misses the SLO" in reasons and "--weight-dtype fp8" in reasons
    assert s.index.free == set(s.index.info)  # nothing was booked
    # not required (the simulator's requests): the best option is placed and marked
    (kept,) = (
        Scheduler(load_preset("hgx-h200")).place(PlacementRequest(model="llama-3.1-405b", slo_tpot_ms=30)).placements
    )
    assert not kept.check("slo").held


def test_remedies_are_empty_without_an_slo_or_when_nothing_helps() -> None:
    s = Scheduler(load_preset("hgx-h100"))
    assert slo_remedies(s, _req()) == []
    assert slo_remedies(s, _req(slo_tpot_ms=1)) == []


def test_capacity_for_a_rate_is_the_fewest_gpus_that_serve_it() -> None:
    s = Scheduler(hgx_h100_cluster(nodes=4))
    sizing = size_for_rate(s, _req(slo_tpot_ms=40), 12.0)
    cap = sizing.capacity
    assert cap.served_rps >= 12.0 and (cap.replicas - 1) * sizing.point.served_rps < 12.0
    assert cap.gpus == cap.replicas * cap.tp * cap.pp
    # no other degree option serves the rate with fewer GPUs
    for cand in s.candidates(_req(slo_tpot_ms=40))[0]:
        point = cand.options.operating(cand.option, cand.options.gpu.native_link)
        if point.meets_slo:
            assert math.ceil(12.0 / point.served_rps) * cand.option.gpus >= cap.gpus
    out = s.place(sizing.request)
    assert len(out.placements) == cap.replicas and not out.unplaced


def test_capacity_refuses_a_bad_rate_and_an_slo_nothing_meets() -> None:
    s = Scheduler(load_preset("hgx-h100"))
    with pytest.raises(InputError, match="not a positive number"):
        size_for_rate(s, _req(slo_tpot_ms=40), float("nan"))
    with pytest.raises(InputError, match="cannot serve"):
        size_for_rate(s, _req(slo_tpot_ms=1), 1.0)

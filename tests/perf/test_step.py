"""StepCost is the latency model of perf/latency.py, step by step: same figures at the design batch."""

from __future__ import annotations

import pytest

from toposched.perf import get_gpu, get_link, predict_latency
from toposched.perf.step import StepCost
from toposched.sim.loading import load_cluster
from toposched.solver.request import PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.solver.stepcost import step_cost
from toposched.workload.catalog import resolve_model

CASES = [
    # model, weight dtype, gpu, tp, pp, link, pp link
    ("llama-3.1-70b", None, "H100-SXM", 4, 1, "nvlink4", None),
    ("llama-3.1-70b", "fp8", "H100-SXM", 8, 1, "ib-ndr", None),
    ("llama-3.1-8b", None, "A100-SXM-80GB", 1, 1, "nvlink3", None),
    ("llama-3.1-405b", "fp8", "H100-SXM", 8, 2, "nvlink4", "ib-ndr"),
    ("mixtral-8x7b", None, "H100-SXM", 2, 1, "pcie5", None),
    ("deepseek-v3", "fp8", "H200", 8, 2, "nvlink4", "ib-ndr"),
]


@pytest.mark.parametrize(("model", "wdt", "gpu", "tp", "pp", "link", "pp_link"), CASES)
@pytest.mark.parametrize(("batch", "input_len", "output_len"), [(1, 128, 16), (32, 1024, 256), (7, 3000, 900)])
def test_design_batch_equals_predict_latency(
    model: str, wdt: str | None, gpu: str, tp: int, pp: int, link: str, pp_link: str | None,
    batch: int, input_len: int, output_len: int,
) -> None:  # fmt: skip
    from toposched.workload.dtypes import parse_weight_dtype

    spec = resolve_model(model, weight_dtype=parse_weight_dtype(wdt) if wdt else None)
    g = get_gpu(gpu)
    links = {"link": get_link(link), "pp_link": get_link(pp_link) if pp_link else None}
    est = predict_latency(spec, g, tp=tp, pp=pp, batch=batch, input_len=input_len, output_len=output_len, **links)
    cost = StepCost(spec, g, tp=tp, pp=pp, **links)
    assert cost.decode_ms(batch, input_len + output_len / 2) == pytest.approx(est.decode.total_ms, rel=1e-9)
    assert cost.prefill_ms(batch, input_len) == pytest.approx(est.prefill.total_ms, rel=1e-9)


def test_mixed_steps_behave() -> None:
    spec = resolve_model("llama-3.1-70b")
    cost = StepCost(spec, get_gpu("H100-SXM"), tp=4, link=get_link("nvlink4"))
    assert cost.step_ms() == 0.0
    one = cost.decode_ms(1, 1000)
    full = cost.decode_ms(64, 1000)
    assert one < full  # more sequences, more KV read and compute
    assert cost.decode_ms(8, 4000) > cost.decode_ms(8, 1000)  # longer contexts read more KV
    # a prefill chunk after earlier chunks costs more than the same chunk at the start (it attends to them)
    assert cost.step_ms(chunks=[(4096, 2048)]) > cost.step_ms(chunks=[(0, 2048)])
    # decodes riding along a prefill chunk cost less than a separate decode step
    alone = cost.step_ms(chunks=[(0, 2048)])
    mixed = cost.step_ms(decode_seqs=16, decode_context=16 * 1000, chunks=[(0, 2048)])
    assert alone < mixed < alone + cost.decode_ms(16, 1000)


def test_placement_step_cost_matches_its_predicted_tpot() -> None:
    """For placements in one domain and across nodes (with and without compression/overlap), the step
    cost at the request's design batch is the TPOT the scheduler predicted for the placement."""
    cluster = load_cluster("4xhgx-h100")
    for policy, slo_class in (("slo", "interactive"), ("random", "batch"), ("random", "realtime")):
        # the design batch's figures (what the simulator plans with): decode step and batch prefill
        scheduler = Scheduler(cluster, seed=3, prediction="design-batch")
        request = PlacementRequest(
            id="r", model="llama-3.1-70b", concurrent_seqs=16, input_len=1024, output_len=256,
            allowed_tp=(8,), slo_class=slo_class,
        )  # fmt: skip
        placement = scheduler.place(request, policy).placements[0]
        cost = step_cost(scheduler, request, placement)
        assert cost.compression == (placement.compression is not None)
        assert cost.decode_ms(16, 1024 + 128) == pytest.approx(placement.tpot_ms, abs=1e-3)
        assert cost.prefill_ms(16, 1024) == pytest.approx(placement.ttft_ms, abs=1e-3)
        if policy == "random":
            assert placement.link.startswith("ib")  # the random TP8 group spans nodes

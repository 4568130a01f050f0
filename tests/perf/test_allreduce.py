"""The alpha-beta all-reduce model, its fit, and the link table built from it."""

from __future__ import annotations

import pytest

from tests.conftest import REFERENCE
from toposched.errors import InfeasibleError, InputError, UnknownNameError
from toposched.perf.allreduce import (
    AlphaBeta,
    Curve,
    fit_alpha_beta,
    fit_measured,
    load_allreduce_csv,
    measured_curves,
)
from toposched.perf.allreduce_tables import MEASURED
from toposched.perf.links import FITTED_SERIES, get_link, two_level_link

CSV = REFERENCE / "data" / "aiconfigurator_allreduce.csv"


def test_time_formula() -> None:
    ab = AlphaBeta(alpha_us=5.0, busbw_gbps=100.0)
    # 1e8 B over 4 GPUs: 1e8 * 2*3/4 / 100 GB/s = 1500 µs, plus alpha
    assert ab.time_us(1e8, 4) == pytest.approx(1505.0)
    assert ab.time_us(1e8, 1) == 0.0


def test_fit_recovers_exact_alpha_beta() -> None:
    truth = AlphaBeta(7.5, 250.0)
    points = [(2**k, truth.time_us(2**k, 8)) for k in range(10, 30, 2)]
    fit = fit_alpha_beta(points, 8)
    assert fit.alpha_us == pytest.approx(7.5, rel=1e-9)
    assert fit.busbw_gbps == pytest.approx(250.0, rel=1e-9)
    with pytest.raises(ValueError):
        fit_alpha_beta(points[:1], 8)


@pytest.mark.skipif(not CSV.exists(), reason="reference data not laid out beside the repository")
def test_link_table_matches_a_refit_of_the_measured_csv() -> None:
    fits = {(r.series, r.n): r for r in fit_measured(load_allreduce_csv(CSV))}
    for series, table in FITTED_SERIES.items():
        for n, ab in table.items():
            r = fits[(series, n)]
            assert ab.alpha_us == pytest.approx(r.fit.alpha_us, rel=0.01), (series, n)
            assert ab.busbw_gbps == pytest.approx(r.fit.busbw_gbps, rel=0.01), (series, n)
    h100_8 = fits[("h100_sxm_comm_nccl_2.27.3", 8)]
    assert h100_8.median_rel_err < 0.15 and h100_8.points == 42


def test_curve_interpolates_in_log_size_and_extends_with_the_last_doubling() -> None:
    curve = Curve(10, (10.0, 10.0, 40.0))  # 1 KiB, 2 KiB, 4 KiB
    assert curve.time_us(512, 2) == 10.0  # below the table: the smallest size's latency
    assert curve.time_us(2048, 2) == 10.0
    assert curve.time_us(2**11.5, 2) == pytest.approx(20.0)  # geometric mean half-way in log size
    # beyond: the last 2 KiB cost 30 µs, so the next 4 KiB cost 60 µs
    assert curve.time_us(8192, 2) == pytest.approx(100.0)
    assert curve.time_us(8192, 1) == 0.0


@pytest.mark.skipif(not CSV.exists(), reason="reference data not laid out beside the repository")
def test_measured_tables_match_the_csv() -> None:
    curves = measured_curves(load_allreduce_csv(CSV))
    assert set(MEASURED) == set(FITTED_SERIES)
    for series, by_n in MEASURED.items():
        assert set(by_n) == set(FITTED_SERIES[series]), series
        for n, curve in by_n.items():
            assert curve == curves[(series, n)], (series, n)


@pytest.mark.skipif(not CSV.exists(), reason="reference data not laid out beside the repository")
def test_prefill_sized_all_reduce_follows_the_measurement_where_alpha_beta_misses() -> None:
    # H100 NCCL, 8 GPUs, 2-32 MiB: the alpha-beta line is 12-30 % fast there (docs/cost-model.md)
    measured = {s.nbytes: s.time_us for s in load_allreduce_csv(CSV) if s.series == "h100_sxm_comm_nccl_2.27.3"
                and s.n == 8}  # fmt: skip
    nccl = MEASURED["h100_sxm_comm_nccl_2.27.3"][8]
    line = FITTED_SERIES["h100_sxm_comm_nccl_2.27.3"][8]
    for size in (2 * 2**20, 8 * 2**20, 32 * 2**20):
        assert nccl.time_us(size, 8) == pytest.approx(measured[size], rel=0.02)
        assert line.time_us(size, 8) < 0.9 * measured[size]


def test_engine_takes_faster_path_and_interpolates() -> None:
    nv4 = get_link("NVLink4")
    small, large = 16 * 1024, 512 * 2**20
    custom = nv4.custom_measured[8].time_us(small, 8)
    assert nv4.allreduce_us(small, 8) == pytest.approx(custom)
    assert custom < nv4.nccl_measured[8].time_us(small, 8)
    assert nv4.allreduce_us(large, 8) <= nv4.nccl_measured[8].time_us(large, 8)
    t2, t4, t6, t8 = (nv4.allreduce_us(small, n) for n in (2, 4, 6, 8))
    assert t2 < t4 < t6 < t8
    assert nv4.allreduce_us(small, 16) > t8  # extrapolated: alpha grows with ring steps


def test_link_limits_and_names() -> None:
    with pytest.raises(InfeasibleError, match="at most 2 GPUs"):
        get_link("nvlink-bridge").allreduce_us(1024, 4)
    with pytest.raises(UnknownNameError, match="did you mean 'ib-ndr'"):
        get_link("ib-nrd")
    # crossing nodes costs far more than NVLink for a decode-sized message
    assert get_link("ib-ndr").allreduce_us(16384, 8) > 3 * get_link("nvlink4").allreduce_us(16384, 8)


def test_two_level_link_pipelines_the_stages_with_in_switch_reduction() -> None:
    link = two_level_link("roce-400", "nvlink4", 8)
    nv4, roce = get_link("nvlink4"), get_link("roce-400")
    assert link.name == "roce-400+nvlink4x8" and link.p2p_us(1e6) == roce.p2p_us(1e6)
    assert link.allreduce_us(1e6, 8) == nv4.allreduce_us(1e6, 8)  # inside one node: the node's link
    size = 2**30
    local = nv4.nccl_measured[8].time_us(size, 8)  # NCCL inside the node, not the custom AR
    across = roce.allreduce_us(size / 8, 2)  # 1/8 of the message per NIC, 2 nodes
    two = link.allreduce_us(size, 16)
    assert max(local, across) < two < 1.01 * max(local, across) + 100  # the slower stage plus a latency
    assert roce.allreduce_us(size, 16) > 5 * two  # a flat NIC ring charges every byte to one NIC
    # A100's NVSwitch has no in-switch reduction: the node and network stages add
    nv3 = get_link("nvlink3")
    a100 = two_level_link("roce-400", "nvlink3", 8).allreduce_us(size, 16)
    assert a100 == pytest.approx(nv3.nccl_measured[8].time_us(size, 8) + across)
    with pytest.raises(InputError, match="gpus_per_node"):
        two_level_link("roce-400", "nvlink4", 0)


def test_pcie_p2p_on_never_costs_more_than_off_and_custom_ar_only_on_two_gpus() -> None:
    on, off = get_link("pcie4"), get_link("pcie4-nop2p")
    for n in range(2, 9):
        for k in range(8, 31):
            # latency-bound sizes (< 16 KiB) may differ by a few %: P2P-on n>2 is the n=2 curve plus
            # the fit's growth with n, P2P-off n>2 its own measured curve
            slack = 1.04 if 2**k < 16384 else 1.0
            assert on.allreduce_us(2**k, n) <= slack * off.allreduce_us(2**k, n), (n, k)
    # vLLM runs its custom all-reduce on two PCIe-only GPUs with P2P: the measured vLLM curve
    custom_2 = MEASURED["car_l40s_comm_vllm_0.22.0:vllm_graph"][2]
    nccl_2 = MEASURED["l40s_comm_nccl_2.27.3"][2]
    assert on.allreduce_us(2**18, 2) == pytest.approx(custom_2.time_us(2**18, 2))
    assert custom_2.time_us(2**18, 2) < nccl_2.time_us(2**18, 2)
    # without P2P, or on more than two PCIe-only GPUs, it is off: NCCL's curve
    assert off.allreduce_us(2**18, 2) == pytest.approx(nccl_2.time_us(2**18, 2))
    assert off.allreduce_us(2**18, 4) == pytest.approx(MEASURED["l40s_comm_nccl_2.27.3"][4].time_us(2**18, 4))
    assert on.allreduce_us(2**18, 4) == pytest.approx(on._nccl_us(2**18, 4))


def test_p2p_off_factor_from_the_tables() -> None:
    """What the tables say about issue 16's "with P2P on it is 5-10x faster" (not tuned to it): the
    measured L40S n=2 pair is the same curve both ways, so only group sizes 4 and 8 differ."""
    on, off = get_link("pcie4"), get_link("pcie4-nop2p")
    big = 64 * 2**20
    assert off.allreduce_us(big, 2) == on.allreduce_us(big, 2)
    assert 2.5 < off.allreduce_us(big, 4) / on.allreduce_us(big, 4) < 2.8
    assert 5.5 < off.allreduce_us(big, 8) / on.allreduce_us(big, 8) < 8.5

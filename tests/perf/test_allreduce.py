"""The alpha-beta all-reduce model, its fit, and the link table built from it."""

from __future__ import annotations

import pytest

from tests.conftest import shared_dir
from toposched.errors import InfeasibleError, UnknownNameError
from toposched.perf.allreduce import AlphaBeta, fit_alpha_beta, fit_measured, load_allreduce_csv
from toposched.perf.links import FITTED_SERIES, get_link

CSV = shared_dir() / "reference" / "data" / "aiconfigurator_allreduce.csv"


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


def test_engine_takes_faster_path_and_interpolates() -> None:
    nv4 = get_link("NVLink4")
    small, large = 16 * 1024, 512 * 2**20
    assert nv4.allreduce_us(small, 8) == pytest.approx(nv4.custom[8].time_us(small, 8))
    assert nv4.allreduce_us(large, 8) <= nv4.nccl[8].time_us(large, 8)
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

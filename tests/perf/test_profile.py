"""perf/profile.py plumbing: ``--profile`` on plan, simulate and serve, and profiles across threads."""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunCli
from toposched.perf.coefficients import PerfConfig
from toposched.perf.profile import (
    Profile,
    ProfileEntry,
    active_config,
    active_profile,
    default_profile,
    load_profile,
    save_profile,
    set_thread_profile,
    use_profile,
)
from toposched.service.config import ServiceConfig

SLOW = Profile(name="slow-hbm", entries=(ProfileEntry(config=PerfConfig(eta_mem=0.3, eta_kv=0.3)),))
FAST = Profile(name="fast-hbm", entries=(ProfileEntry(config=PerfConfig(eta_mem=1.0, eta_kv=1.0)),))


@pytest.fixture
def profiles(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for p in (SLOW, FAST):
        out[p.name] = tmp_path / f"{p.name}.json"
        save_profile(p, out[p.name])
    return out


@pytest.fixture(autouse=True)
def _fresh_step_costs() -> Iterator[None]:
    """solver/stepcost.py caches StepCosts without the profile in the key (see docs/calibrate.md)."""
    from toposched.solver import stepcost

    stepcost._cost.cache_clear()
    yield
    stepcost._cost.cache_clear()


def test_save_load_round_trip(profiles: dict[str, Path]) -> None:
    assert load_profile(profiles["slow-hbm"]) == SLOW


def test_entry_lookup_most_specific_first() -> None:
    p = Profile(
        entries=(
            ProfileEntry(config=PerfConfig(eta_mem=0.5)),
            ProfileEntry(gpu="H100-SXM", config=PerfConfig(eta_mem=0.6)),
            ProfileEntry(gpu="H100-SXM", weight_dtype="fp8", config=PerfConfig(eta_mem=0.7)),
        )
    )
    assert [p.config_for("H100-SXM", d).eta_mem for d in ("fp8", "bf16")] == [0.7, 0.6]
    assert p.config_for("A100-SXM-80GB", "bf16").eta_mem == 0.5


def test_use_profile_is_scoped() -> None:
    with use_profile(SLOW):
        assert active_config("H100-SXM", "bf16").eta_mem == 0.3
        with use_profile(FAST):
            assert active_profile() is FAST
        assert active_profile() is SLOW
    assert active_profile() is default_profile()


def test_worker_threads_need_the_profile_set_in_them() -> None:
    """A thread pool's worker starts with an empty context: ``use_profile`` in the caller is not seen
    there; ``set_thread_profile`` as the pool's initializer (what ``serve`` does) or a copied context is."""
    with use_profile(SLOW), ThreadPoolExecutor(max_workers=1) as plain:
        assert plain.submit(active_profile).result() is default_profile()
        ctx = contextvars.copy_context()
        assert plain.submit(ctx.run, active_profile).result() is SLOW
    with ThreadPoolExecutor(max_workers=1, initializer=set_thread_profile, initargs=(SLOW,)) as pinned:
        assert [pinned.submit(active_profile).result() for _ in range(3)] == [SLOW] * 3
    assert active_profile() is default_profile()  # the main thread is untouched


def _plan_tpot(run_cli: RunCli, *extra: str) -> float:
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "1", "--json", *extra)
    assert result.exit_code == 0, result.stderr
    (p,) = json.loads(result.stdout)["placements"]
    return float(p["predicted"]["tpot_ms"])


def test_plan_profile_changes_the_predicted_tpot(run_cli: RunCli, profiles: dict[str, Path]) -> None:
    before = _plan_tpot(run_cli)
    slow = _plan_tpot(run_cli, "--profile", str(profiles["slow-hbm"]))
    fast = _plan_tpot(run_cli, "--profile", str(profiles["fast-hbm"]))
    assert slow > 2 * fast  # decode reads the weights and the KV cache: 1/0.3 vs 1/1.0 of the HBM bandwidth
    assert _plan_tpot(run_cli) == before  # nothing leaks into a later run without --profile
    assert active_profile() is default_profile()


def test_simulate_profile_changes_the_latencies(run_cli: RunCli, profiles: dict[str, Path]) -> None:
    def tpot(*extra: str) -> float:
        result = run_cli("simulate", "--scenario", "small", "--policies", "slo", "--requests", "20", "--json", *extra)
        assert result.exit_code == 0, result.stderr
        return float(json.loads(result.stdout)["policies"]["slo"]["tpot_p50_ms"])

    # the profile reaches the simulator (placements and step costs; which way p50 moves depends on
    # the degrees the SLO policy then picks, so only the change is asserted)
    assert tpot("--profile", str(profiles["slow-hbm"])) != tpot("--profile", str(profiles["fast-hbm"]))


def test_bad_profile_is_one_line(run_cli: RunCli, tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"version": 1, "entries": [{"config": {"eta_mem": 7}}]}')
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--profile", str(bad))
    assert result.exit_code == 2
    assert "entries.0.config.eta_mem" in result.stderr and "Traceback" not in result.stderr


def test_serve_keeps_the_profile_on_the_loop_and_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --profile``: the main thread (uvicorn's loop: inline state work) and the state's worker
    thread (etcd: every placement) both predict with the profile for the service's lifetime."""
    import uvicorn

    from toposched.cli import serve
    from toposched.topology.sources import SourceRef

    seen: dict[str, Any] = {}

    def fake_run(app: Any, **_: Any) -> None:
        state = app.state.toposched
        seen["loop"] = active_profile()
        seen["worker"] = state.worker.submit(active_profile).result()
        seen["predicted"] = state.worker.submit(lambda: active_config("H100-SXM", "bf16").eta_mem).result()
        state.worker.shutdown(wait=True)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    config = ServiceConfig(
        state="memory", auth=False, source=SourceRef(kind="preset", ref="hgx-h100"), profile=SLOW, port=18080
    )
    serve.run(config)
    assert seen == {"loop": SLOW, "worker": SLOW, "predicted": 0.3}
    assert active_profile() is default_profile()


def test_serve_help_lists_profile(run_cli: RunCli) -> None:
    for command in ("serve", "plan", "simulate"):
        assert "--profile" in run_cli(command, "--help").stdout


def test_a_profile_written_before_the_attention_tables_prices_attention_as_it_was_fitted(tmp_path: Path) -> None:
    """An entry without ``attn_s_half`` (every saved profile lists every field it had) keeps its flat
    ``eta_attn``, reads the KV cache at its ``eta_mem`` and has no kernel floors: the tables' curve and floors
    on top of an ``eta_attn`` fitted without them would price prefill attention up to 5x slower."""
    old = PerfConfig().model_dump(exclude={"attn_s_half", "attn_us", "eta_kv", "attn_us_decode", "attn_seq_ns"})
    old.update(eta_attn=0.5, eta_mem=0.7)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 1, "name": "old", "entries": [{"config": old}]}))
    cfg = load_profile(path).entries[0].config
    assert (cfg.eta_attn, cfg.eta_kv, cfg.attn_s_half, cfg.attn_us, cfg.attn_us_decode, cfg.attn_seq_ns) == (
        0.5, 0.7, 0.0, 0.0, 0.0, 0.0
    )  # fmt: skip
    new = load_profile(_written(tmp_path, PerfConfig(eta_mem=0.7)))
    assert new.entries[0].config.eta_kv == PerfConfig().eta_kv  # a current profile keeps what it says


def test_a_profile_written_before_the_gemm_width_curve_keeps_its_flat_gemm_efficiencies(tmp_path: Path) -> None:
    """Its ``eta_flops`` was fitted as a flat efficiency: the width curve on top would price every GEMM
    slower than it was fitted."""
    old = PerfConfig().model_dump(exclude={"gemm_n_half", "gemm_n_half_fp8"})
    old.update(eta_flops=0.6)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 1, "name": "old", "entries": [{"config": old}]}))
    cfg = load_profile(path).entries[0].config
    assert (cfg.eta_flops, cfg.gemm_n_half, cfg.gemm_n_half_fp8) == (0.6, 0.0, 0.0)
    new = load_profile(_written(tmp_path, PerfConfig(eta_flops=0.6))).entries[0].config
    assert (new.gemm_n_half, new.gemm_n_half_fp8) == (PerfConfig().gemm_n_half, PerfConfig().gemm_n_half_fp8)


def _written(tmp_path: Path, cfg: PerfConfig) -> Path:
    path = tmp_path / "new.json"
    path.write_text(json.dumps({"version": 1, "name": "new", "entries": [{"config": cfg.model_dump()}]}))
    return path

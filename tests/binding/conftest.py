"""Plans for the launch tests, made with ``toposched plan --json`` once per session."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from toposched.binding.plan_doc import PlanDoc, load_plan

DATA = Path(__file__).parent / "data"

PLANS: dict[str, list[str]] = {
    # 8x L40S on PCIe, TP=4: GPUs 0-3 on NUMA node 0 -> numactl.
    "pcie": ["--preset", "l40s-8x-pcie", "--model", "llama-3.1-8b", "--tp", "4"],
    # Two TP=4 replicas on one NVSwitch node: disjoint, NUMA-aligned halves.
    "two": ["--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--replicas", "2"],
    # TP8 x PP2 over two HGX nodes -> one LeaderWorkerSet of size 2.
    "multi": ["--preset", "cluster-32x-hgx-h100", "--model", "llama-3.1-405b", "--slo-tpot-ms", "60"],
}


@pytest.fixture(scope="session")
def plan_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from toposched.cli.main import main

    out = tmp_path_factory.mktemp("plans")
    files: dict[str, Path] = {}
    for name, args in PLANS.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main(["plan", *args, "--json"])
        files[name] = out / f"{name}.json"
        files[name].write_text(buf.getvalue())
    return files


@pytest.fixture(scope="session")
def plans(plan_files: dict[str, Path]) -> dict[str, PlanDoc]:
    return {name: load_plan(path) for name, path in plan_files.items()}

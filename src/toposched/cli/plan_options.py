"""The plan options, declared once: each ``PlanSource`` field's Typer option, and the decorator that
gives a command all of them as one ``source: PlanSource`` argument (``plan`` and every ``launch``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import typer

from toposched.cli._common import CLUSTER, LIVE, P2P, PRESET, SMI
from toposched.cli.calibrate import PROFILE
from toposched.cli.plan_source import PlanSource
from toposched.solver.pd import KV_STORES
from toposched.solver.policies import POLICIES
from toposched.solver.request import DEFAULT_MAX_MODEL_LEN

_OPTIONS: dict[str, tuple[Any, Any]] = {
    # field: (annotation, typer.Option); the launch commands use them only without --plan.
    "model": (
        str | None,
        typer.Option(None, "--model", "-m", help="Catalog name, Hugging Face id or config.json path."),
    ),
    "smi": (str | None, SMI),
    "preset": (str | None, PRESET),
    "cluster": (str | None, CLUSTER),
    "live": (bool, LIVE),
    "p2p": (str | None, P2P),
    "gpu": (str | None, typer.Option(None, "--gpu", help="GPU type when the topology does not say (e.g. H100-SXM).")),
    "replicas": (int, typer.Option(1, "--replicas", help="Instances to place.")),
    "tp": (int | None, typer.Option(None, "--tp", help="Force this tensor-parallel degree.")),
    "ep": (int, typer.Option(1, "--ep", help="Expert-parallel degree (MoE; must divide tp).")),
    "expert_replicas": (int, typer.Option(0, "--expert-replicas", help="Copies of hot experts allowed (ep > 1).")),
    "expert_hit_rates": (
        str | None,
        typer.Option(
            None, "--expert-hit-rates", help="Per-expert hit rates, comma-separated (ep > 1).", metavar="R0,R1,..."
        ),
    ),
    "max_pp": (int, typer.Option(8, "--max-pp", help="Largest pipeline-parallel degree to consider.")),
    "slo_tpot_ms": (float | None, typer.Option(None, "--slo-tpot-ms", help="Per-token latency SLO.")),
    "slo_ttft_ms": (float | None, typer.Option(None, "--slo-ttft-ms", help="Time-to-first-token SLO.")),
    "slo_class": (str, typer.Option("interactive", "--slo-class", help="realtime|interactive|standard|batch.")),
    "max_model_len": (
        int,
        typer.Option(
            DEFAULT_MAX_MODEL_LEN,
            "--max-model-len",
            help=f"Context length to reserve KV for (default {DEFAULT_MAX_MODEL_LEN}, as fit and the service; a plan "
            "reserves KV for several sequences of this length).",
        ),
    ),
    "concurrent_seqs": (
        int | None,
        typer.Option(
            None,
            "--concurrent-seqs",
            help="Running sequences per instance (the engines' max-num-seqs). Default: the operating point, the "
            "largest batch meeting the SLO (without one, the throughput knee) that the KV cache holds.",
        ),
    ),
    "input_len": (int, typer.Option(1024, "--input-len", help="Typical prompt length for predictions.")),
    "output_len": (int, typer.Option(256, "--output-len", help="Typical output length for predictions.")),
    "pd_mode": (
        str | None,
        typer.Option(
            None,
            "--pd",
            help="auto (with --request-rate): plan aggregated instances or prefill/decode pools, whichever serves "
            "the rate within the SLO with fewer GPUs; the plan says why.",
        ),
    ),
    "request_rate": (
        float | None,
        typer.Option(
            None,
            "--request-rate",
            help="Requests/s to serve at --input-len/--output-len: plan the fewest GPUs that serve it within the "
            "SLO (replicas, degree and operating point); exit 1 naming the GPUs missing when the cluster cannot.",
        ),
    ),
    "weight_dtype": (str | None, typer.Option(None, "--weight-dtype", help="bf16|fp16|fp8|int8|int4.")),
    "engine_version": (
        str | None,
        typer.Option(
            None,
            "--engine-version",
            help="The engine's version (e.g. 0.11.0): a calibration profile entry fitted on it, and from the "
            "version its tables measured the engine's own MoE kernels, price the plan.",
        ),
    ),
    "kv_dtype": (str | None, typer.Option(None, "--kv-dtype", help="auto|fp8|int8|int4.")),
    "affinity": (str, typer.Option("auto", "--affinity", help="auto|nvlink|pcie-switch|numa|node|none.")),
    "policy": (str, typer.Option("slo", "--policy", help=f"Placement policy: {'|'.join(POLICIES.names())}.")),
    "busy": (str | None, typer.Option(None, "--busy", help="GPUs already taken: 0,1,... or NODE/INDEX,...")),
    "budget_gbps": (float, typer.Option(256.0, "--budget-gbps", help="Cross-domain traffic budget (GB/s).")),
    "seed": (int, typer.Option(0, "--seed", help="Seed for the random policy.")),
    "pd_prefill": (
        int,
        typer.Option(0, "--pd-prefill", help="Prefill instances of a prefill/decode disaggregated plan (TTFT SLO)."),
    ),
    "pd_decode": (
        int,
        typer.Option(
            0, "--pd-decode", help="Decode instances of a disaggregated plan (TPOT SLO), near a prefill's rack."
        ),
    ),
    "kv_store": (
        str | None,
        typer.Option(None, "--kv-store", help=f"KV-cache store beside the decode instances: {'|'.join(KV_STORES)}."),
    ),
    "pd_same_rack_required": (
        bool,
        typer.Option(
            False, "--pd-same-rack-required", help="Place no decode instance outside the racks of the prefill ones."
        ),
    ),
}
_PLAN_FILE = (Path | None, typer.Option(None, "--plan", help="Output of `toposched plan --json`.", metavar="PLAN.json"))

F = TypeVar("F", bound=Callable[..., Any])


def plan_options(*, plan_file: bool) -> Callable[[F], F]:
    """Give a command every plan option (and ``--plan`` when ``plan_file``); it receives them as one
    ``source: PlanSource`` keyword argument.

    The command's own parameters come first in ``--help``; the plan options follow, in the order above.
    """

    def decorate(command: F) -> F:
        own = inspect.signature(command)
        if "source" not in own.parameters:
            raise TypeError(f"{command.__name__} must take a 'source: PlanSource' parameter")
        declared = dict(_OPTIONS)
        declared["profile"] = (Path | None, PROFILE)
        if plan_file:
            declared = {"plan": _PLAN_FILE, **declared}
        names = {f.name for f in fields(PlanSource)}
        assert set(declared) <= names, set(declared) - names  # a declared option must be a PlanSource field
        params = [p for p in own.parameters.values() if p.name != "source"]
        params += [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
            for name, (annotation, option) in declared.items()
        ]

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in declared if name in kwargs}
            return command(*args, source=PlanSource(**values), **kwargs)

        wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # Typer must read the new signature, not the command's
        return wrapper  # type: ignore[return-value]

    return decorate

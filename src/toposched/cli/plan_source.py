"""Where a plan comes from, declared once for ``plan`` and every ``launch`` command.

``toposched plan`` and ``toposched launch ... --model`` make the same plan from the same options, so
the options live once: :func:`plan_options` (``cli/plan_options.py``) adds them to a command's
signature and hands the command one :class:`PlanSource` value instead of thirty parameters. ``plan``
makes and prints the plan (:meth:`PlanSource.place`); the launch commands take ``--plan PLAN.json``
or, without it, plan now (:meth:`PlanSource.resolve`) through the same document and checks
(``binding/plan_doc.py``).

Bad values are refused before any topology is read, with the flag named: a ``--tp`` the model's
heads cannot be split by, an unknown ``--policy``, a request field out of range.

``--pd-prefill N --pd-decode M`` plans a prefill/decode disaggregated deployment instead of
``--replicas`` instances (``solver/pd.py``): the same model, lengths and SLOs, the TTFT SLO sizing the
prefill instances and the TPOT SLO the decode instances, with ``--kv-store`` stores beside them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from toposched.binding.plan_doc import PlanDoc, load_plan, parse_plan, plan_json
from toposched.cli._common import err_console, source_ref
from toposched.cli.calibrate import profile_option
from toposched.cli.progress import Reporter
from toposched.errors import InfeasibleError, InputError, first_problem
from toposched.perf.profile import Profile, use_profile
from toposched.solver.outcome import Outcome
from toposched.solver.pd import KV_STORES, Disaggregation, KvStore, place_pd
from toposched.solver.policies import POLICIES
from toposched.solver.request import DEFAULT_MAX_MODEL_LEN, PlacementRequest, Role, Unplaced
from toposched.solver.scheduler import Scheduler
from toposched.solver.sizing import Capacity, ModeChoice, choose_mode, missing_gpus, size_for_rate
from toposched.topology.model import Cluster
from toposched.topology.sources import Loaded, SourceRef, load_source
from toposched.workload import resolve_model
from toposched.workload.catalog import base_checkpoint_note
from toposched.workload.parallel import tp_problem, valid_tps


@dataclass(frozen=True)
class PlanSource:
    """Everything that says which plan to launch: a plan file, or a model, a topology and the request."""

    plan: Path | None = None
    model: str | None = None
    smi: str | None = None
    preset: str | None = None
    cluster: str | None = None
    live: bool = False
    p2p: str | None = None
    gpu: str | None = None
    replicas: int = 1
    tp: int | None = None
    ep: int = 1
    expert_replicas: int = 0
    expert_hit_rates: str | None = None
    max_pp: int = 8
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None
    slo_class: str = "interactive"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    concurrent_seqs: int | None = None
    input_len: int = 1024
    output_len: int = 256
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    affinity: str = "auto"
    policy: str = "slo"
    busy: str | None = None
    budget_gbps: float = 256.0
    seed: int = 0
    profile: Path | None = None
    pd_prefill: int = 0
    pd_decode: int = 0
    kv_store: str | None = None
    pd_same_rack_required: bool = False
    request_rate: float | None = None
    pd_mode: str | None = None
    engine: str | None = None
    """The engine the plan is sized for (``plan --engine``; a launch command's own engine); None: vllm."""
    engine_version: str | None = None
    """Its version (``plan --engine-version``): a calibration profile entry fitted on it prices the plan."""

    def topology(self) -> SourceRef | None:
        """The one topology source the flags name (None when none is given)."""
        return source_ref(self.smi, self.preset, self.cluster, self.live, self.p2p)

    def disaggregation(self) -> Disaggregation | None:
        """The prefill/decode split the ``--pd-*`` flags ask for (None: a plain plan), checked flag by flag."""
        pd = self.pd_prefill or self.pd_decode
        if self.pd_mode is not None:
            if self.pd_mode != "auto":
                raise InputError(f"--pd {self.pd_mode!r:.20} is not a mode", fix="pass --pd auto, or leave it out")
            if pd:
                raise InputError("--pd auto chooses the roles itself", fix="leave out --pd-prefill/--pd-decode")
            if self.request_rate is None:
                raise InputError(
                    "--pd auto compares aggregated and disaggregated instances for a request rate",
                    fix="add --request-rate R (requests/s)",
                )
            if self.kv_store is not None and self.kv_store not in KV_STORES:
                raise InputError(
                    f"--kv-store {self.kv_store!r:.40} is not known", fix=f"use one of: {', '.join(KV_STORES)}"
                )
            return None
        if not pd:
            if self.kv_store is not None or self.pd_same_rack_required:
                flag = "--kv-store" if self.kv_store is not None else "--pd-same-rack-required"
                raise InputError(f"{flag} needs a disaggregated plan", fix="add --pd-prefill N --pd-decode M")
            return None
        for flag, value in (("--pd-prefill", self.pd_prefill), ("--pd-decode", self.pd_decode)):
            if not 1 <= value <= 1024:
                raise InputError(
                    f"{flag} {value}: a disaggregated plan has 1 to 1024 of each role", fix=f"pass {flag} N"
                )
        if self.replicas != 1:
            raise InputError(
                f"--replicas {self.replicas} with --pd-prefill/--pd-decode", fix="give the instances per role only"
            )
        if self.kv_store is not None and self.kv_store not in KV_STORES:
            raise InputError(
                f"--kv-store {self.kv_store!r:.40} is not known", fix=f"use one of: {', '.join(KV_STORES)}"
            )
        return Disaggregation(
            prefill=self.pd_prefill,
            decode=self.pd_decode,
            kv_store="mooncake" if self.kv_store else None,
            same_rack_required=self.pd_same_rack_required,
        )

    def request(self) -> PlacementRequest:
        """The placement request, checked flag by flag (errors name the flag, exit 2)."""
        if self.model is None:
            raise InputError("no model to plan", fix="pass --model NAME (a catalog name, Hugging Face id or path)")
        if self.input_len + self.output_len > self.max_model_len:
            raise InputError(
                f"--input-len {self.input_len} + --output-len {self.output_len} is longer than --max-model-len "
                f"{self.max_model_len}: the engine would stop such a request early",
                fix="raise --max-model-len or shorten the lengths",
            )
        if self.request_rate is not None:
            if not (math.isfinite(self.request_rate) and 0 < self.request_rate <= 1e6):
                raise InputError(
                    f"--request-rate {self.request_rate:g} is not a rate", fix="give requests/s, more than 0 (e.g. 20)"
                )
            if self.replicas != 1:
                raise InputError(
                    f"--replicas {self.replicas} with --request-rate", fix="give one: the rate sizes the replicas"
                )
        POLICIES.get(self.policy)  # unknown names fail here with the valid ones
        if self.tp is not None:
            spec = resolve_model(self.model)
            problem = tp_problem(spec, self.tp)
            if problem:
                raise InputError(f"--tp {self.tp}: {problem}", fix="valid tp: " + ", ".join(map(str, valid_tps(spec))))
        try:
            return PlacementRequest(
                id="plan",
                model=self.model,
                replicas=self.replicas,
                allowed_tp=(self.tp,) if self.tp else None,
                ep=self.ep,
                expert_replicas=self.expert_replicas,
                expert_hit_rates=_rates(self.expert_hit_rates),
                max_pp=self.max_pp,
                slo_tpot_ms=self.slo_tpot_ms,
                slo_ttft_ms=self.slo_ttft_ms,
                slo_class=self.slo_class,
                max_model_len=self.max_model_len,
                concurrent_seqs=self.concurrent_seqs,
                slo_required=True,
                input_len=self.input_len,
                output_len=self.output_len,
                weight_dtype=self.weight_dtype,
                kv_dtype=self.kv_dtype,
                affinity=self.affinity,
                engine=self.engine or "vllm",
                engine_version=self.engine_version,
            )
        except ValidationError as exc:
            bad = first_problem(exc)
            if bad.loc:
                flag = "--" + bad.field.replace("_", "-")
                raise InputError(f"{flag}: {bad.msg} (got {bad.input!r:.60})") from None
            raise InputError(f"request: {bad.reason}") from None

    def place(self, progress: Reporter | None = None) -> Placed:
        """Plan now: the request, the topology it was placed on and the outcome (placed and unplaced).

        ``progress``: where the stages go (reading the topology, indexing its GPUs, placing), for a large
        cluster's seconds (``plan --cluster`` at 65,536 GPUs: about 1 s, 6 s and 0.1 s)."""
        progress = progress or Reporter("plan", quiet=True)
        ref = self.topology()
        if ref is None:
            raise InputError(
                "planning needs a topology", fix="pass --preset NAME, --smi FILE, --cluster FILE or --live"
            )
        request = self.request()
        pd = self.disaggregation()
        chosen = profile_option(self.profile)  # a bad profile fails before the topology is read
        progress.stage(f"reading the topology ({ref.describe()[:80]})")
        loaded = load_source(ref)
        for w in loaded.warnings:
            err_console.print(f"warning: {w}", markup=False, soft_wrap=True)
        busy = parse_gpu_list(self.busy, loaded.cluster, "--busy")
        progress.stage(f"indexing {sum(len(n.gpus) for n in loaded.cluster.nodes):,} GPUs")
        scheduler = Scheduler(loaded.cluster, gpu=self.gpu, busy=busy, budget_gbps=self.budget_gbps, seed=self.seed)
        progress.stage("placing")
        with use_profile(chosen):
            if self.request_rate is not None and pd is not None:
                raise InputError("--request-rate sizes plain instances", fix="leave out --pd-prefill/--pd-decode")
            try:
                if self.pd_mode == "auto" and self.request_rate is not None:
                    return self._auto(request, scheduler, ref, loaded, chosen, self.request_rate)
                sizing = size_for_rate(scheduler, request, self.request_rate) if self.request_rate is not None else None
            except InfeasibleError as exc:  # no option meets the SLO: not placed, like any SLO miss (exit 1)
                reasons = (exc.message, *((exc.fix,) if exc.fix else ()))
                refused = Unplaced(request_id=request.id, replica=0, status="rejected", reasons=reasons)
                return Placed(request, ref, loaded, Outcome(unplaced=[refused]), self.policy, chosen)
            if sizing is not None:
                outcome = scheduler.place(sizing.request, policy=self.policy)
                short = missing_gpus(scheduler, sizing, len(outcome.placements)) if outcome.unplaced else None
                placed = Placed(sizing.request, ref, loaded, outcome, self.policy, chosen, capacity=sizing.capacity)
                return dataclasses.replace(placed, shortfall=short)
            if pd is None:
                return Placed(request, ref, loaded, scheduler.place(request, policy=self.policy), self.policy, chosen)
            made = place_pd(scheduler, request, pd, policy=self.policy)
        return Placed(request, ref, loaded, made.outcome, self.policy, chosen, made.layout, tuple(made.stores))

    def _auto(
        self, request: PlacementRequest, scheduler: Scheduler, ref: SourceRef, loaded: Loaded,
        chosen: Profile | None, rate: float,
    ) -> Placed:  # fmt: skip
        """``--pd auto``: aggregated or disaggregated, whichever serves the rate with fewer GPUs (``choose_mode``)."""
        choice, agg, pd = choose_mode(scheduler, request, rate)
        if choice.chosen == "aggregated":
            assert agg is not None
            outcome = scheduler.place(agg.request, policy=self.policy)
            short = missing_gpus(scheduler, agg, len(outcome.placements)) if outcome.unplaced else None
            return Placed(
                agg.request, ref, loaded, outcome, self.policy, chosen, capacity=agg.capacity, shortfall=short,
                mode=choice,
            )  # fmt: skip
        assert pd is not None
        layout = Disaggregation(
            prefill=choice.prefill, decode=choice.decode, kv_store="mooncake" if self.kv_store else None,
            same_rack_required=self.pd_same_rack_required,
        )  # fmt: skip
        degrees: dict[Role, tuple[int, int]] = {
            "prefill": (pd.prefill.capacity.tp, pd.prefill.capacity.pp),
            "decode": (pd.decode.capacity.tp, pd.decode.capacity.pp),
        }
        made = place_pd(scheduler, request, layout, policy=self.policy, degrees=degrees)
        short = None
        if made.outcome.unplaced:
            per = {
                role: sized.capacity.tp * sized.capacity.pp
                for role, sized in (("prefill", pd.prefill), ("decode", pd.decode))
            }
            need = sum(per["prefill" if u.request_id.endswith("-prefill") else "decode"] for u in made.outcome.unplaced)
            short = (
                f"{len(made.outcome.unplaced)} of {layout.prefill + layout.decode} disaggregated instances could not "
                f"be placed: {need} more {pd.decode.capacity.gpu} GPUs are needed "
                f"({len(scheduler.index.free)} GPUs are left free)"
            )
        return Placed(
            request, ref, loaded, made.outcome, self.policy, chosen, made.layout, tuple(made.stores),
            shortfall=short, mode=choice,
        )  # fmt: skip

    def resolve(self, engine: str | None = None, *, quiet: bool = True) -> PlanDoc:
        """The plan to launch with ``engine``: read from ``--plan`` (as it is: ``request.engine`` says what it
        was sized for), or made now from ``--model`` and a topology source, sized for ``engine``; planning
        shows its stages as ``plan`` does unless ``quiet`` (``cli/progress.py``)."""
        if self.plan is not None:
            if self.model is not None or self.topology() is not None:
                raise InputError("give --plan, or --model with a topology source, not both")
            if self.engine_version is not None:
                raise InputError(
                    "give --plan (its request says the engine version it was sized for) or --engine-version"
                )
            # used as it is, whichever engine launches it: its request says the engine it was sized for
            return load_plan(self.plan)
        if engine is not None and self.engine not in (None, engine):
            raise InputError(f"the plan is sized for {self.engine} but launched with {engine}", fix="use one engine")
        if engine is not None:
            return replace(self, engine=engine).resolve(quiet=quiet)
        if self.model is None or self.topology() is None:
            raise InputError(
                "launch needs a plan", fix="pass --plan PLAN.json, or --model NAME with --preset/--smi/--cluster/--live"
            )
        with Reporter("launch", quiet=quiet) as progress:
            placed = self.place(progress)
        for u in placed.outcome.unplaced:
            reason = u.reasons[0] if u.reasons else ""
            err_console.print(f"warning: replica {u.replica} not placed: {reason}", markup=False, soft_wrap=True)
        if not placed.outcome.placements:
            raise InputError(
                f"nothing of {self.model} could be placed on {placed.ref.describe()}",
                fix="run `toposched plan` with the same options for the reasons",
            )
        return parse_plan(placed.document(with_unplaced=False), "the plan")


def note_base_checkpoint(doc: PlanDoc, model_path: str | None = None) -> None:
    """Say on stderr when the plan's catalog name launches a base checkpoint (``--model-path``: the path is served)."""
    note = None if model_path else base_checkpoint_note(doc.request.model)
    if note:
        err_console.print(f"note: {note}", markup=False, soft_wrap=True)


@dataclass(frozen=True)
class Placed:
    """A plan made now: what was asked, where, and what came out."""

    request: PlacementRequest
    ref: SourceRef
    loaded: Loaded
    outcome: Outcome
    policy: str
    profile: Profile | None
    """The cost-model profile the predictions used (``--profile``)."""
    disaggregation: Disaggregation | None = None
    """The prefill/decode split and pairs of a disaggregated plan (None: a plain plan)."""
    stores: tuple[KvStore, ...] = ()
    """The KV-cache stores of a disaggregated plan."""
    capacity: Capacity | None = None
    """With ``--request-rate``: what the replicas were sized to serve (``solver/sizing.py``)."""
    shortfall: str | None = None
    """With ``--request-rate``: one line on the GPUs missing when not every replica could be placed."""
    mode: ModeChoice | None = None
    """With ``--pd auto``: aggregated or disaggregated, the GPUs of each, and why."""

    def document(self, *, with_unplaced: bool = True) -> dict[str, Any]:
        """The plan document (``plan --json``), under the profile the plan was made with."""
        with use_profile(self.profile):
            return plan_json(
                self.outcome.placements,
                self.outcome.unplaced if with_unplaced else [],
                self.request,
                self.loaded.cluster,
                policy=self.policy,
                source=self.ref.describe(),
                disaggregation=self.disaggregation,
                stores=self.stores,
                capacity=self.capacity,
                mode=self.mode,
            )


def parse_gpu_list(text: str | None, cluster: Cluster, flag: str) -> list[str]:
    """'0,1,5' (single-node clusters) or 'node/0,node/1' -> GPU refs; errors name the flag."""
    if not text:
        return []
    known = {f"{n.name}/{g.index}" for n in cluster.nodes for g in n.gpus}
    refs: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if "/" in item:
            ref = item
        elif item.isascii() and item.isdigit():
            if len(cluster.nodes) != 1:
                raise InputError(
                    f"{flag} {item!r}: this cluster has {len(cluster.nodes)} nodes", fix="write NODE/INDEX"
                )
            ref = f"{cluster.nodes[0].name}/{item}"
        else:
            raise InputError(f"{flag}: {item!r} is not a GPU index", fix="give indices like 0,1,2 or NODE/INDEX")
        if ref not in known:
            raise InputError(f"{flag}: GPU {ref} is not in the topology")
        if ref in refs:
            raise InputError(f"{flag}: GPU {ref} is listed twice", fix="name each GPU once")
        refs.append(ref)
    return refs


def _rates(text: str | None) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise InputError(f"--expert-hit-rates: {exc}", fix="give numbers like 0.2,0.1,0.05,...") from exc

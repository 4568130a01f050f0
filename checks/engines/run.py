"""``make check-engines``: every launch toposched makes for the corpus, checked by the real tools.

    .venv/bin/python -m checks.engines.run [--venv DIR] [--work DIR]

1. Builds (or finds) the cached engines venv (``build_venv.sh``): vLLM 0.33.0, SGLang 0.5.23, CPU torch.
2. Makes the corpus (``corpus.py``): plans on every preset, launched for vLLM, SGLang and Ray, and for
   TensorRT-LLM as scripts and Kubernetes objects (no TensorRT-LLM parser can run here).
3. Runs every distinct vLLM argv through vLLM's ``serve`` parser and config validation
   (``check_vllm.py``) and every SGLang argv through ``prepare_server_args`` and SGLang's checks
   (``check_sglang.py``), both in the engines venv, in parallel; what the engine resolved must agree
   with the plan (degrees, nodes, experts, context, dtypes; for a prefill/decode instance its role and
   KV devices, SGLang's disaggregation flags or vLLM's ``--kv-transfer-config``). Canaries, wrong variants of corpus
   commands that the engines must refuse, show the checks can fail.
4. Meanwhile (``static_checks.py``): no two commands of a plan on one port of one node; shellcheck
   on every ``--format sh`` script and on the pods' entrypoint scripts; the Deployments,
   ResourceClaimTemplates (DRA), LeaderWorkerSets, RoleBasedGroups and CoordinatedPolicies through
   kubernetes-validate (Kubernetes 1.37, strict) and the CRD schemas (``crd_schemas.py``).
5. Prints one row per plan (vllm, sglang, ray, ports, sh, k8s), what toposched refused, the
   engines' warnings, the failures with the first lines of each error, and the totals; exits 1 on
   any failure (a venv that cannot be built is one).

What is stubbed and why: ``gpu_stub/toposched_gpu_stub/__init__.py`` (only what needs a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from checks.engines import corpus as corpus_mod
from checks.engines.case_runner import numactl_rest
from checks.engines.corpus import Corpus, EngineCase
from checks.engines.static_checks import Finding, check_k8s, check_scripts, port_findings
from toposched.binding.engines import VLLM_KV_CONNECTOR, VLLM_KV_ROLES, VLLM_MULTI_CONNECTOR
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import ToposchedError

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 1200
MAX_SHOWN = 60
"""Failures printed in full; the rest are counted."""
V100 = "Tesla V100-SXM2-32GB;7.0;34359738368;80"
COLUMNS = ("vllm", "sglang", "ray", "ports", "sh", "k8s")
IGNORED_WARNINGS = (
    # Said because this machine has no GPU driver, not because of the command.
    "Model Runner V2 requires Triton",
    "nvidia-smi not found",
)


# --- engines --------------------------------------------------------------------------------------


def model_arg(engine: str, argv: list[str]) -> str | None:
    """The model an engine command names (``vllm serve MODEL`` / ``--model-path MODEL``)."""
    try:
        rest = numactl_rest(argv)
    except ValueError:
        return None
    if engine == "vllm":
        return rest[2] if len(rest) > 2 and rest[:2] == ["vllm", "serve"] else None
    return rest[rest.index("--model-path") + 1] if "--model-path" in rest[:-1] else None


def case_json(case: EngineCase, case_id: str | None = None) -> dict[str, Any]:
    model = model_arg(case.engine, case.argv)
    config = None
    if model is not None:
        try:
            config = corpus_mod.model_config(model)
        except ToposchedError:
            config = None  # the engine will say it cannot find the model
    return {
        "id": case_id or case.id,
        "argv": case.argv,
        "env": {**case.env, "TOPOSCHED_IB_DEVICES": case.ib_devices} if case.ib_devices else case.env,
        "gpu": case.gpu,
        "model": model,
        "model_config": str(config) if config else None,
    }


def with_flag(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag`` set to ``values`` (replaced where present, else appended)."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        del out[i : i + 1 + len(values)]
    return [*out, flag, *values]


def _degree(argv: list[str], flag: str) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else 1


def canaries(cases: list[EngineCase]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Wrong variants of corpus commands, and what the engine must refuse them for."""
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {"vllm": [], "sglang": []}
    vllm = next((c for c in cases if c.engine == "vllm" and _degree(c.argv, "--tensor-parallel-size") > 1), None)
    if vllm is not None:
        out["vllm"] = [
            (
                "an unknown flag",
                {**case_json(vllm, "canary/vllm/unknown-flag"), "argv": [*vllm.argv, "--tp-rank-map", "0"]},
            ),
            (
                "a context longer than the model's",
                {**case_json(vllm, "canary/vllm/context"), "argv": with_flag(vllm.argv, "--max-model-len", "1000000")},
            ),
            (
                "more ranks than the node's GPUs",
                {**case_json(vllm, "canary/vllm/devices"), "env": {**vllm.env, "CUDA_VISIBLE_DEVICES": "0"}},
            ),
            (
                "FP8 weights on a V100",
                {
                    **case_json(vllm, "canary/vllm/fp8-v100"),
                    "argv": with_flag(vllm.argv, "--quantization", "fp8"),
                    "gpu": V100,
                },
            ),
        ]
    sglang = next(
        (c for c in cases if c.engine == "sglang" and "sglang.launch_server" in c.argv and "--nnodes" not in c.argv),
        None,
    )
    if sglang is not None:
        ranks = _degree(sglang.argv, "--tp-size") * _degree(sglang.argv, "--pp-size")
        nodes = next(n for n in range(2, 64) if ranks % n)
        dist = ["--nnodes", str(nodes), "--node-rank", "0", "--dist-init-addr", "127.0.0.1:20000"]
        out["sglang"] = [
            (
                "an unknown flag",
                {**case_json(sglang, "canary/sglang/unknown-flag"), "argv": [*sglang.argv, "--tp-rank-map", "0"]},
            ),
            (
                "a context longer than the model's",
                {
                    **case_json(sglang, "canary/sglang/context"),
                    "argv": with_flag(sglang.argv, "--context-length", "1000000"),
                },
            ),
            (
                "a KV cache dtype SGLang does not have",
                {**case_json(sglang, "canary/sglang/kv"), "argv": with_flag(sglang.argv, "--kv-cache-dtype", "int4")},
            ),
            (
                "--nnodes that does not divide the ranks",
                {**case_json(sglang, "canary/sglang/nnodes"), "argv": [*sglang.argv, *dist]},
            ),
        ]
    kv = next((c for c in cases if "--kv-transfer-config" in c.argv), None)
    if kv is not None:
        config = json.loads(kv.argv[kv.argv.index("--kv-transfer-config") + 1])
        wrong = with_flag(kv.argv, "--kv-transfer-config", json.dumps({**config, "kv_role": "kv_sender"}))
        out["vllm"].append(("an unknown kv_role", {**case_json(kv, "canary/vllm/kv-role"), "argv": wrong}))
    pd = next((c for c in cases if "--disaggregation-ib-device" in c.argv), None)
    if pd is not None:
        wrong = with_flag(pd.argv, "--disaggregation-ib-device", "mlx5_99")
        out["sglang"].append(
            ("an IB device the node does not have", {**case_json(pd, "canary/sglang/ib-device"), "argv": wrong})
        )
    router = next((c for c in cases if "sglang_router.launch_router" in c.argv), None)
    if router is not None:
        wrong = [*router.argv, "--prefill-url", "http://nowhere:1"]
        out["sglang"].append(("an unknown router flag", {**case_json(router, "canary/sglang/router"), "argv": wrong}))
    return out


def start_engine(
    engine: str, venv: Path, cases: list[dict[str, Any]], work: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    folder = work / engine
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cases.json").write_text(json.dumps({"cases": cases}))
    results = folder / "results.jsonl"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(venv / "vllm-cache")}
    with (folder / "engine.log").open("wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [
                str(venv / "bin" / "python"),
                str(HERE / f"check_{engine}.py"),
                str(folder / "cases.json"),
                str(results),
                str(folder),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return proc, results


def engine_results(
    engine: str, proc: subprocess.Popen[bytes], results: Path, deadline: float
) -> tuple[dict[str, Any], str | None]:
    """Results by case id, and why the checker stopped early (None when it finished)."""
    problem = None
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            problem = f"the {engine} checker exited with {code}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        problem = f"the {engine} checker ran past {ENGINE_TIMEOUT_S} s"
    found = {}
    if results.exists():
        for line in results.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                found[record["id"]] = record
    if problem:
        log = results.parent / "engine.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        problem += " (log: " + str(log) + ")\n" + "\n".join(tail)
    return found, problem


# --- the run --------------------------------------------------------------------------------------


def build_venv() -> Path:
    proc = subprocess.run(["bash", str(HERE / "build_venv.sh")], stdout=subprocess.PIPE, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(1)  # build_venv.sh said why, in one line, on stderr
    return Path(lines[-1])


def _native_quantization(model: str | None) -> bool:
    """Whether the model's checkpoint is quantized already (its config.json has a quantization_config)."""
    if model is None:
        return False
    try:
        config = corpus_mod.model_config(model) or Path(model) / "config.json"
        return "quantization_config" in json.loads(config.read_text())
    except (ToposchedError, OSError, ValueError):
        return False


def disagreements(case: EngineCase, doc: PlanDoc, resolved: dict[str, Any]) -> list[str]:
    """Where what the engine resolved differs from what the plan relies on (degrees, context, dtypes)."""
    if "pd" in resolved:  # the router: every prefill (with its bootstrap port) and decode instance, PD mode
        return _router_disagreements(doc, resolved)
    placement = next((p for p in doc.placements if p.id == case.id.rsplit("/", 2)[1]), None)
    if placement is None:
        return []
    ray = case.id.endswith("/ray-driver")
    said: list[str] = []

    def differ(what: str, got: Any, planned: Any) -> None:
        if got != planned:
            shown = "the model's own maximum" if got is None else repr(got)
            said.append(f"{what}: the engine would run {shown}, the plan has {planned!r}")

    differ("tensor parallel", resolved.get("tp"), placement.tp)
    differ("pipeline parallel", resolved.get("pp"), placement.pp)
    differ("context length", resolved.get("max_len"), doc.request.max_model_len)
    if not ray:
        differ("nodes", resolved.get("nnodes"), len({r.node for r in placement.ranks}))
    ep = resolved.get("ep")
    differ(
        "expert parallel",
        ep if case.engine == "sglang" else bool(ep),
        placement.ep if case.engine == "sglang" else placement.ep > 1,
    )
    redundant = placement.experts.redundant_experts if placement.experts else 0
    differ("redundant experts", resolved.get("redundant_experts"), redundant)
    quant = resolved.get("quantization") or ""
    native = _native_quantization(model_arg(case.engine, case.argv))
    if (doc.request.weight_dtype or "").lower() == "fp8" and "fp8" not in quant and not (native and not quant):
        said.append(f"weights: the plan has FP8 weights, the engine would load them as {quant or 'unquantized 16-bit'}")
    if not doc.request.weight_dtype and quant and not native:
        said.append(f"weights: the plan has the checkpoint's 16-bit weights, the engine would quantize them ({quant})")
    nics = {nic for r, nic in zip(placement.ranks, placement.kv_nics, strict=False) if r.node == case.node}
    if case.engine == "sglang" and not ray:
        differ("disaggregation mode", resolved.get("disaggregation_mode"), placement.role or "null")
        differ("KV transfer devices", _ib_devices(resolved.get("ib_device")), nics)
    if case.engine == "vllm" and not ray:
        differ("KV transfer role", resolved.get("kv_role"), VLLM_KV_ROLES.get(placement.role or ""))
        connector = VLLM_MULTI_CONNECTOR if doc.stores else VLLM_KV_CONNECTOR  # with a store: P2P + store
        differ("KV connector", resolved.get("kv_connector"), connector if placement.role else None)
        devices = {d for d in str(resolved.get("kv_devices") or "").split(",") if d}
        differ("KV transfer devices", devices, nics)
    kv = str(resolved.get("kv_dtype") or "auto")
    if placement.kv_dtype == "auto" and kv != "auto":
        said.append(f"KV cache: the plan has the model's dtype, the engine would use {kv}")
    if placement.kv_dtype != "auto" and placement.kv_dtype not in kv:
        said.append(f"KV cache: the plan has {placement.kv_dtype}, the engine would use {kv}")
    return said


def _ib_devices(value: Any) -> set[str]:
    """The devices of a resolved ``--disaggregation-ib-device`` (a comma list or a per-GPU JSON mapping)."""
    if not value:
        return set()
    groups = json.loads(value).values() if str(value).startswith("{") else [value]
    return {d for group in groups for d in str(group).split(",") if d}


def _router_disagreements(doc: PlanDoc, resolved: dict[str, Any]) -> list[str]:
    said = [] if resolved.get("pd") else ["the router would not run in prefill/decode mode"]
    for role, key in (("prefill", "prefill"), ("decode", "decode")):
        count = sum(1 for p in doc.placements if p.role == role)
        if len(resolved.get(key, [])) != count:
            said.append(f"the router has {len(resolved.get(key, []))} {role} server(s), the plan {count}")
    if any(port is None for _, port in resolved.get("prefill", [])):
        said.append("a prefill server without its bootstrap port")
    return said


def engine_findings(
    engine: str, corpus: Corpus, results: dict[str, Any], canary_list: list[tuple[str, dict[str, Any]]]
) -> list[Finding]:
    findings = []
    first: dict[str, str] = {}
    docs = {p.name: p.doc for p in corpus.plans if p.doc is not None}
    for case in corpus.engine_cases:
        if case.engine != engine:
            continue
        representative = first.setdefault(case.key(), case.id)
        record = results.get(representative)
        column = "ray" if case.id.endswith("/ray-driver") else engine
        plan = case.id.rsplit("/", 2)[0]
        if record is None:
            findings.append(Finding(plan, column, case.id, False, "no result (the checker stopped before this case)"))
        elif record["ok"]:
            said = disagreements(case, docs[plan], record.get("resolved", {}))
            findings.append(Finding(plan, column, case.id, not said, "\n".join(said) or record.get("detail", "")))
        else:
            findings.append(Finding(plan, column, case.id, False, record.get("error", "")))
    for what, canary in canary_list:
        record = results.get(canary["id"])
        if record is None:
            findings.append(Finding("canaries", engine, canary["id"], False, "no result"))
        elif record["ok"]:
            message = f"the engine accepted {what}: the check cannot see this kind of error ({record.get('detail')})"
            findings.append(Finding("canaries", engine, canary["id"], False, message))
        else:
            findings.append(Finding("canaries", engine, canary["id"], True, f"refused {what}"))
    return findings


def warnings_of(results: dict[str, Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for record in results.values():
        if not record["id"].startswith("canary/"):
            counts.update(w for w in record.get("warnings", []) if not any(i in w for i in IGNORED_WARNINGS))
    return counts


def print_report(findings: list[Finding], corpus: Corpus, warnings: dict[str, Counter[str]]) -> int:
    cells: dict[str, dict[str, list[Finding]]] = defaultdict(lambda: defaultdict(list))
    for f in findings:
        cells[f.plan][f.column].append(f)
    width = max([len(p) for p in cells] + [len(p.name) for p in corpus.plans] + [4])
    print(f"\n{'plan':<{width}}  " + "  ".join(f"{c:<10}" for c in COLUMNS))
    for plan in [p.name for p in corpus.plans] + ["canaries"]:
        if plan not in cells:
            reason = next((p.skipped for p in corpus.plans if p.name == plan and p.skipped), None)
            if reason:
                print(f"{plan:<{width}}  skipped: {reason[:90]}")
            continue
        row = []
        for column in COLUMNS:
            got = cells[plan][column]
            bad = sum(f.ok is False for f in got)
            good = sum(f.ok is True for f in got)
            row.append("-" if not got else f"FAIL {bad}/{len(got)}" if bad else f"ok {good}" if good else "refused")
        print(f"{plan:<{width}}  " + "  ".join(f"{c:<10}" for c in row))
    failures = sorted((f for f in findings if f.ok is False), key=lambda f: not f.case.endswith(" checker"))
    refused = [f for f in findings if f.ok is None]
    if refused:
        print(f"\nRefused by toposched (not failures): {len(refused)}")
        for f in refused[:20]:
            print(f"  {f.case}: {f.message.splitlines()[0][:200]}")
    for engine, counts in warnings.items():
        if counts:
            print(f"\n{engine} warnings (not failures), by number of commands:")
            for text, n in counts.most_common(10):
                print(f"  {n:4d}  {text[:200]}")
    if failures:
        print(f"\nFailures: {len(failures)}")
        for f in failures[:MAX_SHOWN]:
            print(f"- [{f.column}] {f.case}")
            for line in f.message.splitlines()[:8]:
                print(f"    {line[:400]}")
        if len(failures) > MAX_SHOWN:
            print(f"... and {len(failures) - MAX_SHOWN} more, of these cases:")
            for column, n in Counter(f.column for f in failures[MAX_SHOWN:]).items():
                print(f"    {column}: {n}")
    print("\nTotals:")
    for column in (*COLUMNS, "plan", "corpus"):
        got = [f for f in findings if f.column == column]
        if got:
            print(
                f"  {column:<7} {sum(f.ok is True for f in got):4d} ok  {sum(f.ok is False for f in got):4d} failed"
                f"  {sum(f.ok is None for f in got):4d} refused"
            )
    passed, failed = sum(f.ok is True for f in findings), len(failures)
    print(f"\nEngine checks: {passed} passed, {failed} failed")
    return 1 if failed else 0


def coverage_findings(corpus: Corpus, kinds: Counter[str]) -> list[Finding]:
    """The corpus must hold every category and every object kind, or the checks prove little."""
    findings = [
        Finding("corpus", "corpus", f"category {c}", c in corpus.covered(), "no plan of this category was placed")
        for c in corpus_mod.CATEGORIES
    ]
    for kind in ("Deployment", "LeaderWorkerSet", "ResourceClaimTemplate", "RoleBasedGroup", "CoordinatedPolicy"):
        findings.append(Finding("corpus", "corpus", f"kind {kind}", kinds[kind] > 0, "no object of this kind rendered"))
    for plan in corpus.plans:
        if plan.failure:
            findings.append(Finding(plan.name, "plan", plan.name, False, plan.failure))
    return [f for f in findings if f.ok is False or f.column == "plan"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check-engines", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--venv", type=Path, help="use this engines venv instead of building the cached one")
    parser.add_argument("--work", type=Path, help="keep cases, logs and scripts here (default: a temporary folder)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    venv = args.venv or build_venv()
    work = args.work or Path(tempfile.mkdtemp(prefix="toposched-engine-checks-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = corpus_mod.build(work)
    unique: dict[str, dict[str, EngineCase]] = {"vllm": {}, "sglang": {}}
    for case in corpus.engine_cases:
        unique[case.engine].setdefault(case.key(), case)
    canary_lists = canaries(corpus.engine_cases)
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    running = {
        engine: start_engine(
            engine, venv, [case_json(c) for c in unique[engine].values()] + [c for _, c in canary_lists[engine]], work
        )
        for engine in ("vllm", "sglang")
    }
    print(
        f"check-engines: {len(corpus.plans)} plans, {len(corpus.engine_cases)} engine commands "
        f"({sum(map(len, unique.values()))} distinct) in {venv}; work folder {work}",
        flush=True,
    )
    findings = check_scripts(corpus, venv, work) + port_findings(corpus.engine_cases)
    k8s, kinds = check_k8s(corpus.plans, venv, work)
    findings += k8s
    for name, message in corpus.refusals:
        findings.append(Finding(name.rsplit("/", 1)[0], name.rsplit("/", 1)[1], name, None, f"refused: {message}"))
    warnings: dict[str, Counter[str]] = {}
    for engine, (proc, results_path) in running.items():
        results, problem = engine_results(engine, proc, results_path, deadline)
        if problem:
            findings.append(Finding("corpus", engine, f"{engine} checker", False, problem))
        findings += engine_findings(engine, corpus, results, canary_lists[engine])
        warnings[engine] = warnings_of(results)
    findings += coverage_findings(corpus, kinds)
    code = print_report(findings, corpus, warnings)
    print(f"check-engines: {time.monotonic() - started:.0f} s")
    if code == 0 and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    elif code:
        print(f"check-engines: cases, engine logs and scripts kept in {work}")
    return code


if __name__ == "__main__":
    sys.exit(main())

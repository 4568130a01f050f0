"""The checks that need no engine: ports, shellcheck on the scripts, the Kubernetes objects' schemas.

Each returns ``Finding`` values (``run.py`` prints them): ``ok`` true, false (a failure) or None
(toposched refused, with its reason). Each also checks a canary, a wrong input it must refuse.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate

from checks.engines import corpus as corpus_mod
from checks.engines.corpus import IMAGES, Corpus, EngineCase, Plan
from checks.engines.crd_schemas import SCHEMAS, pod_templates
from toposched.binding.k8s import render_objects, render_roles
from toposched.binding.k8s_options import K8sOptions
from toposched.binding.k8s_pd import render_pd
from toposched.binding.plan_doc import PlanDoc
from toposched.cli.launch import write_scripts
from toposched.errors import ToposchedError

K8S_VERSION = "1.37"
"""kubernetes-validate's newest bundled schemas (as tests/binding/test_k8s.py)."""
SHELLCHECK_TIMEOUT_S = 300


@dataclass
class Finding:
    """One checked thing: ``ok`` true, false (a failure) or None (skipped or refused, with the reason)."""

    plan: str
    column: str
    case: str
    ok: bool | None
    message: str = ""
    path: Path | None = None
    """The script a ``sh`` finding is about."""


# --- ports ----------------------------------------------------------------------------------------


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def bound_ports(case: EngineCase) -> list[int]:
    """The fixed ports a command listens on, on its own node.

    Every server binds ``--port``. The head of a multi-node instance also binds the rendezvous:
    vLLM ``--master-port`` (torch's TCP store), SGLang the port of ``--dist-init-addr``, and with
    ``--enable-dp-attention`` the six ZMQ ports above it (``PortArgs.init_new``). Other ports are
    picked free at run time.
    """
    ports = [int(p) for p in [_value(case.argv, "--port")] if p]
    if case.node_rank != 0:
        return ports
    master = _value(case.argv, "--master-port")
    if case.engine == "vllm" and master:
        ports.append(int(master))
    dist = _value(case.argv, "--dist-init-addr")
    if case.engine == "sglang" and dist and ":" in dist:
        port = int(dist.rsplit(":", 1)[1])
        ports += range(port, port + 7) if "--enable-dp-attention" in case.argv else [port]
    return ports


def port_findings(cases: list[EngineCase]) -> list[Finding]:
    """Within a plan, no two commands of one launch (vLLM, SGLang or Ray drivers) may bind one port of one node."""
    groups: dict[tuple[str, str], list[EngineCase]] = defaultdict(list)
    for case in cases:
        launcher = "ray" if case.id.endswith("/ray-driver") else case.engine
        groups[(case.id.rsplit("/", 2)[0], launcher)].append(case)
    findings = []
    for (plan, kind), members in groups.items():
        taken: dict[tuple[str, int], str] = {}
        clashes = []
        for case in members:
            for port in bound_ports(case):
                other = taken.setdefault((case.node, port), case.id)
                if other != case.id:
                    clashes.append(
                        f"port {port} on {case.node}: {other.rsplit('/', 2)[1]} and {case.id.rsplit('/', 2)[1]}"
                    )
        findings.append(Finding(plan, "ports", f"{plan}/{kind}/ports", not clashes, "\n".join(clashes[:5])))
    return findings


SH_CANARY = "#!/usr/bin/env bash\nset -euo pipefail\nexport NCCL_IB_HCA==mlx5_0,mlx5_1\nexec vllm serve m\n"
"""The unquoted ``==`` value the launcher once wrote (issue 14 item 13): shellcheck must flag it (SC1097)."""


# --- shell scripts --------------------------------------------------------------------------------


def shellcheck(venv: Path, files: list[Path], shell: str | None = None) -> dict[Path, list[str]]:
    """shellcheck's findings per file (all severities), as ``SC1097 (error) line 4: message``."""
    if not files:
        return {}
    cmd = [str(venv / "bin" / "shellcheck"), "--format=json1", "--norc"] + ([f"--shell={shell}"] if shell else [])
    proc = subprocess.run(
        [*cmd, *map(str, files)], capture_output=True, text=True, timeout=SHELLCHECK_TIMEOUT_S, check=False
    )
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"shellcheck failed ({proc.returncode}): {proc.stderr.strip()[:300]}")
    found: dict[Path, list[str]] = defaultdict(list)
    for c in json.loads(proc.stdout or '{"comments": []}')["comments"]:
        found[Path(c["file"])].append(f"SC{c['code']} ({c['level']}) line {c['line']}: {c['message']}")
    return found


def scripts(corpus: Corpus, work: Path) -> list[tuple[str, str, Path]]:
    """Every ``--format sh`` script, written by ``write_scripts`` as ``toposched launch --out`` does."""
    by_plan: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for case_id, launch in corpus.launches:
        plan = case_id.rsplit("/", 2)[0]
        by_plan[(plan, launch.engine)].append(launch)
    out = []
    for (plan, engine), launches in by_plan.items():
        folder = work / "sh" / re.sub(r"[^A-Za-z0-9.-]+", "_", plan) / engine
        for path in write_scripts(launches, folder):
            if path.suffix == ".sh":  # not the files a launch reads (TensorRT-LLM's options YAML, hostfile)
                out.append((plan, f"{plan}/{engine}/{path.name}", path))
    return out


def check_scripts(corpus: Corpus, venv: Path, work: Path) -> list[Finding]:
    """shellcheck on every ``--format sh`` script, and on the canary it must flag."""
    findings = [Finding(plan, "sh", case, True, path=path) for plan, case, path in scripts(corpus, work)]
    canary = work / "sh" / "canary-unquoted.sh"
    canary.write_text(SH_CANARY)
    comments = shellcheck(venv, [f.path for f in findings if f.path] + [canary])
    for f in findings:
        said = comments.get(f.path, []) if f.path else []
        f.ok, f.message = not said, "\n".join(said[:5])
    flagged = any("SC1097" in c for c in comments.get(canary, []))
    message = "refused the unquoted ==mlx5_0 value (SC1097)" if flagged else "shellcheck did not flag SC1097"
    findings.append(Finding("canaries", "sh", "canary/sh/unquoted-value", flagged, message))
    return findings


# --- Kubernetes -----------------------------------------------------------------------------------


def _pod_template(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}


def object_problems(obj: dict[str, Any]) -> list[str]:
    """Why ``obj`` is not valid: kubernetes-validate for built-in kinds, the CRD schema otherwise."""
    kind = f"{obj.get('kind')} {obj.get('metadata', {}).get('name', '?')}"
    schema = SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    problems = []
    if schema is None:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            problems.append(f"{kind}: {str(exc).splitlines()[0][:300]}")
        return problems
    for error in jsonschema.Draft202012Validator(schema).iter_errors(obj):
        path = ".".join(str(p) for p in error.absolute_path)
        problems.append(f"{kind}: {path or '(top)'}: {error.message[:300]}")
    for where, template in pod_templates(obj):
        try:
            kubernetes_validate.validate(_pod_template(template), K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{kind}: {where}: {str(exc).splitlines()[0][:300]}")
    return problems


def entrypoints(obj: dict[str, Any]) -> list[str]:
    """The shell scripts of an object: a plan's ConfigMap's files (what the pods run since issue 36), or an
    inline ``sh -c`` command as the kubelet hands it to the shell (``$$`` -> ``$``)."""
    if obj.get("kind") == "ConfigMap":
        return [str(v) for k, v in sorted(obj.get("data", {}).items()) if k.endswith(".sh")]
    templates = [t for _, t in pod_templates(obj)]
    if obj.get("kind") == "Deployment":
        templates.append(obj["spec"]["template"])
    found = []
    for template in templates:
        for container in template.get("spec", {}).get("containers", []):
            command = container.get("command", [])
            if len(command) == 3 and command[1] == "-c" and command[0].endswith("sh"):
                found.append(str(command[2]).replace("$$", "$"))
    return found


def k8s_renders(plans: list[Plan]) -> Iterable[tuple[str, str, Callable[[], Any]]]:
    """(plan, case, render) for every variant: each plan alone, and a RoleBasedGroup per preset."""
    for plan in plans:
        for case, doc, engine in corpus_mod.k8s_variants(plan):
            opts = K8sOptions(engine=engine, image=IMAGES.get(engine))
            if plan.doc is not None and plan.doc.disaggregation is not None:
                # One RoleBasedGroup for the whole disaggregated deployment (SGLang only); the variant keeps its roles.
                if engine == "sglang":
                    pd_doc = dataclasses.replace(doc, disaggregation=plan.doc.disaggregation, stores=plan.doc.stores)
                    yield plan.name, f"{case}/pd-role-based-group", partial(render_pd, pd_doc, plan.label, opts)
                continue
            yield plan.name, f"{case}/objects", partial(render_objects, doc, opts)
            if all(len({r.node for r in p.ranks}) == 1 for p in doc.placements):
                yield plan.name, f"{case}/role-based-group", partial(render_roles, {"serve": doc}, plan.label, opts)
    by_preset: dict[str, list[tuple[str, PlanDoc]]] = defaultdict(list)
    for plan in plans:
        if (
            plan.doc is not None
            and plan.doc.disaggregation is None
            and all(len({r.node for r in p.ranks}) == 1 for p in plan.doc.placements)
        ):
            by_preset[plan.preset].append((plan.name, plan.doc))
    for preset, single in by_preset.items():
        if len(single) >= 2:
            (name, prefill), (_, decode) = single[0], single[1]
            for variant, pinned in (("device-plugin", False), ("dra-uuid", True)):
                docs = {
                    "prefill": corpus_mod.captured(prefill, uuids=True) if pinned else prefill,
                    "decode": corpus_mod.captured(decode, uuids=True) if pinned else decode,
                }
                yield name, f"{preset}/prefill-decode/{variant}/role-based-group", partial(render_roles, docs, "pd")


def k8s_canaries(samples: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Rendered objects with one invented or misspelt field each: the validation must refuse every one."""
    out = []
    if "Deployment" in samples:
        obj = json.loads(json.dumps(samples["Deployment"]))
        obj["spec"]["template"]["spec"]["topologyAwarePlacement"] = True
        out.append(("a field Kubernetes does not have in a Deployment's pod spec", obj))
    if "ResourceClaimTemplate" in samples:
        obj = json.loads(json.dumps(samples["ResourceClaimTemplate"]))
        obj["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClass"] = "gpu.nvidia.com"
        out.append(("a misspelt deviceClassName in a DRA request", obj))
    if "LeaderWorkerSet" in samples:
        obj = json.loads(json.dumps(samples["LeaderWorkerSet"]))
        obj["spec"]["topologyAwarePlacement"] = True
        out.append(("a field the LeaderWorkerSet CRD does not have", obj))
        obj = json.loads(json.dumps(samples["LeaderWorkerSet"]))
        obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["gpuIds"] = [0]
        out.append(("a field Kubernetes does not have in an LWS worker pod", obj))
    if "RoleBasedGroup" in samples:
        obj = json.loads(json.dumps(samples["RoleBasedGroup"]))
        obj["spec"]["roles"][0]["rolloutStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"type": "Surge"}}
        out.append(("a rolling-update type RBG does not have", obj))
    return out


def check_k8s(plans: list[Plan], venv: Path, work: Path) -> tuple[list[Finding], Counter[str]]:
    findings: list[Finding] = []
    kinds: Counter[str] = Counter()
    samples: dict[str, dict[str, Any]] = {}
    scripts_dir = work / "entrypoints"
    scripts_dir.mkdir(parents=True, exist_ok=True)
    pending: list[tuple[Finding, list[Path]]] = []
    for plan, case, render in k8s_renders(plans):
        try:
            output = render()
        except ToposchedError as exc:
            findings.append(Finding(plan, "k8s", case, None, f"refused: {exc}"))
            continue
        problems = [p for obj in output.objects for p in object_problems(obj)]
        kinds.update(obj["kind"] for obj in output.objects)
        for obj in output.objects:
            samples.setdefault(obj["kind"], obj)
        paths = []
        for obj in output.objects:
            for text in entrypoints(obj):
                path = scripts_dir / f"{len(list(scripts_dir.iterdir())):05d}.sh"
                path.write_text(text)
                paths.append(path)
        finding = Finding(plan, "k8s", case, not problems, "\n".join(problems[:5]))
        findings.append(finding)
        pending.append((finding, paths))
    comments = shellcheck(venv, [p for _, paths in pending for p in paths], shell="sh")
    for finding, paths in pending:
        said = [f"entrypoint: {c}" for p in paths for c in comments.get(p, [])]
        if said:
            finding.ok = False
            finding.message = "\n".join([finding.message, *said[:5]]).strip()
    for what, obj in k8s_canaries(samples):
        refused = bool(object_problems(obj))
        message = f"refused {what}" if refused else f"accepted {what}: the validation cannot see this kind of error"
        findings.append(Finding("canaries", "k8s", f"canary/k8s/{obj['kind']}", refused, message))
    return findings, kinds

"""``toposched launch k8s|k8s-lint|ray`` (Kubernetes objects and Ray placement groups)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.table import Table
from rich.text import Text

from toposched.binding.k8s import lint_nodes, render_objects, render_roles
from toposched.binding.k8s_dra import GPU_REQUESTS, GpuRequest
from toposched.binding.k8s_options import DEFAULT_RACK_LABEL, K8sOptions
from toposched.binding.k8s_pd import render_pd
from toposched.binding.kubelet import kubelet_configs
from toposched.binding.plan_doc import PlanDoc, load_plan
from toposched.binding.ray import check_ray_engine, ray_document, ray_warnings
from toposched.cli._common import console, err_console, print_json
from toposched.cli.plan_options import plan_options
from toposched.cli.plan_source import PlanSource, note_base_checkpoint
from toposched.cli.progress import QUIET
from toposched.errors import InputError
from toposched.inputs import load_json, read_text

RACK_LABEL = typer.Option(DEFAULT_RACK_LABEL, "--rack-label", help="Node label that holds the rack.")
ENGINE = typer.Option("vllm", "--engine", help="vllm, sglang or trtllm (TensorRT-LLM).")


def _dump_yaml(docs: list[Any]) -> str:
    """YAML documents written only by the safe serialiser (no anchors, no comments, no raw input text)."""

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, explicit_start=True)


def _engine(name: str) -> Any:
    if name not in ("vllm", "sglang", "trtllm"):
        raise InputError(f"--engine {name[:40]!r} is not one of vllm, sglang, trtllm")
    return name


def _gpu_request(name: str) -> GpuRequest:
    for choice in GPU_REQUESTS:
        if name == choice:
            return choice
    raise InputError(f"--gpu-request {name!r} is not one of {', '.join(GPU_REQUESTS)}")


def _warn(warnings: list[str]) -> None:
    for w in warnings:  # plain text: no markup from the inputs
        err_console.print(f"warning: {w}", markup=False, soft_wrap=True)


def _roles(spec: str) -> dict[str, PlanDoc]:
    """``prefill=A.json,decode=B.json`` -> role name -> plan."""
    roles: dict[str, PlanDoc] = {}
    for part in spec.split(","):
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise InputError(
                f"--roles item {part!r} is not ROLE=PLAN.json", fix="e.g. --roles prefill=p.json,decode=d.json"
            )
        if name.strip() in roles:
            raise InputError(f"--roles names {name.strip()!r} twice")
        roles[name.strip()] = load_plan(path.strip())
    return roles


def register_launch(launch_app: typer.Typer) -> None:
    """Add the Kubernetes and Ray commands to the ``launch`` group."""

    @launch_app.command("k8s")
    @plan_options(plan_file=True)
    def k8s(
        engine: str = ENGINE,
        image: str | None = typer.Option(None, "--image", help="Container image (default vllm/vllm-openai:v0.33.0)."),
        namespace: str = typer.Option("default", "--namespace", help="Namespace of the objects."),
        name_prefix: str = typer.Option("toposched", "--name-prefix", help="Prefix of object names."),
        model_path: str | None = typer.Option(None, "--model-path", help="Model path/id inside the container."),
        rack_label: str = RACK_LABEL,
        shm_size: str | None = typer.Option(None, "--shm-size", help="sizeLimit of the /dev/shm emptyDir."),
        cpu: str | None = typer.Option(None, "--cpu", help="CPU request and limit per pod."),
        memory: str | None = typer.Option(None, "--memory", help="Memory request and limit per pod."),
        gpu_request: str = typer.Option(
            "auto",
            "--gpu-request",
            help="dra (ResourceClaimTemplates that pin the planned GPUs), device-plugin (nvidia.com/gpu: N), "
            "or auto: dra when the plan has real bus ids/UUIDs.",
        ),
        roles: str | None = typer.Option(
            None, "--roles", help="ROLE=PLAN.json,... : a RoleBasedGroup and CoordinatedPolicy instead."
        ),
        group: str = typer.Option(
            "pd", "--group", help="Name of the RoleBasedGroup (with --roles, or a disaggregated plan)."
        ),
        rdma_resource: str | None = typer.Option(
            None,
            "--rdma-resource",
            help="RDMA resource of a disaggregated plan's pods (default: the cluster fabric's, else "
            "rdma/hca_shared_devices_a).",
        ),
        ssh_secret: str | None = typer.Option(
            None,
            "--ssh-secret",
            help="Secret (keys ssh-privatekey, ssh-publickey) through which a multi-node TensorRT-LLM leader's "
            "mpirun reaches its worker pods (default NAME_PREFIX-mpi-ssh).",
        ),
        scheduler: str = typer.Option(
            "default",
            "--scheduler",
            help="default|kai|kueue|volcano: the cluster scheduler that admits each instance as one gang "
            "(PodGroups, queue labels, topology constraints), the GPUs staying the plan's.",
        ),
        queue: str | None = typer.Option(
            None,
            "--queue",
            help="The scheduler's queue (default: kai default-queue, kueue user-queue, volcano default).",
        ),
        scheduler_topology: str = typer.Option(
            "cluster-topology", "--scheduler-topology", help="KAI: the Topology object the PodGroups refer to."
        ),
        dra_driver_version: str = typer.Option(
            "25.12.0",
            "--dra-driver-version",
            help="The NVIDIA DRA driver release of the cluster; before 25.12.0 GPUs are pinned by UUID only.",
        ),
        hf_token_secret: str | None = typer.Option(
            None,
            "--hf-token-secret",
            help="NAME[:KEY] of the Secret whose key (default token) is the engine's HF_TOKEN, for gated models "
            "(default: Secret hf-token if it exists).",
        ),
        model_cache: str | None = typer.Option(
            None,
            "--model-cache",
            help="pvc:NAME or host:/PATH mounted as the Hugging Face cache, so a restart does not download the "
            "weights again.",
        ),
        kubelet: bool = typer.Option(False, "--kubelet", help="Print KubeletConfiguration snippets instead."),
        topology_policy: str = typer.Option(
            "auto",
            "--topology-policy",
            help="Topology Manager policy (with --kubelet); auto: single-numa-node only where no pod spans NUMA nodes.",
        ),
        fmt: str = typer.Option("yaml", "--format", help="yaml or json."),
        quiet: bool = QUIET,
        *,
        source: PlanSource,
    ) -> None:
        """Kubernetes objects: a Deployment per single-node placement, a LeaderWorkerSet per multi-node one
        (TensorRT-LLM: its leader runs mpirun over the worker pods); for a prefill/decode disaggregated plan,
        one RoleBasedGroup with its Services."""
        if fmt not in ("yaml", "json"):
            raise InputError(f"--format {fmt!r} is not one of yaml, json for Kubernetes objects")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
            raise InputError(
                f"--namespace {namespace[:80]!r} is not a Kubernetes namespace",
                fix="use lower-case letters, digits and '-', at most 63 characters, starting and ending alphanumeric",
            )
        opts = K8sOptions(
            engine=_engine(engine), image=image, namespace=namespace, name_prefix=name_prefix, model_path=model_path,
            rack_label=rack_label, shm_size=shm_size, cpu=cpu, memory=memory, gpu_request=_gpu_request(gpu_request),
            rdma_resource=rdma_resource, mpi_ssh_secret=ssh_secret, hf_token_secret=hf_token_secret,
            model_cache=model_cache, dra_driver_version=dra_driver_version, scheduler=scheduler,
            queue=queue, scheduler_topology=scheduler_topology,
        )  # fmt: skip
        if roles is not None:
            if source.plan is not None or source.model is not None:
                raise InputError("--roles takes the plans itself; leave out --plan/--model")
            output = render_roles(_roles(roles), group, opts)
        else:
            doc = source.resolve(opts.engine, quiet=quiet)
            opts.check_image_version(doc.request.engine_version)
            if kubelet:
                # Node names and the reason travel in fields, never in a YAML comment: only the serialiser writes.
                configs = [k.document() for k in kubelet_configs(doc, policy=topology_policy)]
                if fmt == "json":
                    print_json({"kubelet_configs": configs})
                else:
                    print(_dump_yaml(configs), end="")
                return
            # A disaggregated plan is one RoleBasedGroup (prefill, decode, router, stores); a plain one is not.
            output = render_pd(doc, group, opts) if doc.disaggregation is not None else render_objects(doc, opts)
        _warn(output.warnings)
        if fmt == "json":
            print_json({"apiVersion": "v1", "kind": "List", "items": output.objects})
        else:
            print(_dump_yaml(output.objects), end="")
        if roles is None:
            note_base_checkpoint(doc, model_path)

    @launch_app.command("k8s-lint")
    @plan_options(plan_file=True)
    def k8s_lint(
        nodes: Path = typer.Option(..., "--nodes", help="Output of `kubectl get nodes -o json`.", metavar="NODES.json"),
        rack_label: str = RACK_LABEL,
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
        quiet: bool = QUIET,
        *,
        source: PlanSource,
    ) -> None:
        """Check real nodes against the plan: every planned node present, with every label its affinity uses."""
        doc = source.resolve(quiet=quiet)
        data = load_json(read_text(nodes, what="nodes file"), source=str(nodes))
        findings = lint_nodes(doc, data, K8sOptions(rack_label=rack_label))
        if json_out:
            print_json(
                {
                    "ok": not findings,
                    "findings": [{"placement": f.placement, "node": f.node, "problem": f.problem} for f in findings],
                }
            )
        elif findings:
            table = Table(title=f"{len(findings)} problem(s): these pods would stay Pending")
            for column in ("placement", "node", "problem"):
                table.add_column(column)
            for f in findings:
                table.add_row(Text(f.placement), Text(f.node), Text(f.problem))  # no markup from the inputs
            console.print(table)
        else:
            console.print("ok: every planned node exists and carries the labels its affinity uses", markup=False)
        if findings:
            raise typer.Exit(1)

    @launch_app.command("ray")
    @plan_options(plan_file=True)
    def ray(
        model_path: str | None = typer.Option(None, "--model-path", help="Model path/id vLLM loads."),
        engine: str = typer.Option("vllm", "--engine", help="vllm (the one engine with a Ray executor here)."),
        fmt: str = typer.Option("json", "--format", help="json or yaml."),
        quiet: bool = QUIET,
        *,
        source: PlanSource,
    ) -> None:
        """Ray placement groups (one GPU per bundle, tied to its NVLink domain) and `ray start` flags per node."""
        if fmt not in ("yaml", "json"):
            raise InputError(f"--format {fmt!r} is not one of json, yaml for Ray placement groups")
        ray_engine = _engine(engine)
        check_ray_engine(ray_engine)  # before planning: the answer does not depend on the plan
        doc = source.resolve(ray_engine, quiet=quiet)
        document = ray_document(doc, model_path=model_path, engine=ray_engine)
        _warn(ray_warnings(doc))
        if fmt == "json":
            print_json(document)
        else:
            print(_dump_yaml([document]), end="")
        note_base_checkpoint(doc, model_path)

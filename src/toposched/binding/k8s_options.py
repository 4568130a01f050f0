"""How a plan is rendered for Kubernetes (``K8sOptions``: engine, image, namespace, resources, how pods get
their GPUs) and the names and labels every object toposched writes carries."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from toposched.binding.k8s_dra import DEFAULT_DRA_DRIVER, GPU_REQUESTS, GpuRequest, parse_driver_version
from toposched.binding.node_launch import Engine
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError, first_problem
from toposched.perf.engine_names import engine_version, version_matches
from toposched.topology.model import ResourceName

Obj = dict[str, Any]

# The vLLM image tag follows the `vllm/vllm-openai:v0.8.5` form of the LWS example (engines.md 4),
# pinned to the engine version whose flags the emitter uses (vLLM 0.33.0, engines.md 1).
DEFAULT_IMAGES: dict[Engine, str | None] = {"vllm": "vllm/vllm-openai:v0.33.0", "sglang": None, "trtllm": None}
# Kubernetes has no well-known rack label; this is toposched's own, overridable with --rack-label.
DEFAULT_RACK_LABEL = "toposched.io/rack"
LABEL_PLACEMENT = "toposched.io/placement"
ANNOTATION_PLACEMENT = "toposched.io/placement"
"""The pod annotation holding the exact placement id (labels hold a DNS-1123 name derived from it)."""
LABEL_REQUEST = "toposched.io/request"
MANAGED_BY = {"app.kubernetes.io/managed-by": "toposched"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")  # a Secret's data key (Kubernetes IsConfigMapKey)
_HOST_PATH = re.compile(r"^/[A-Za-z0-9._/-]{0,4095}$")
MODEL_CACHE_DIR = "/root/.cache/huggingface"
"""Where the model cache is mounted and ``HF_HOME`` points (the engine images run as root: vLLM's, SGLang's
and TensorRT-LLM's download to ``~/.cache/huggingface`` by default)."""
DEFAULT_HF_SECRET = "hf-token"
SCHEDULER_NAMES = ("default", "kai", "kueue", "volcano")
"""``--scheduler`` values (``k8s_schedulers.py``)."""


@dataclass(frozen=True)
class K8sOptions:
    """How to render a plan for Kubernetes."""

    engine: Engine = "vllm"
    image: str | None = None
    """Container image; None takes the engine's pinned default (vLLM only)."""
    namespace: str = "default"
    name_prefix: str = "toposched"
    model_path: str | None = None
    """Model path/id inside the container (default: the request's model)."""
    rack_label: str = DEFAULT_RACK_LABEL
    shm_size: str | None = None
    """sizeLimit of the /dev/shm emptyDir (memory-backed; counts against the pod's memory)."""
    cpu: str | None = None
    """CPU request = limit (Guaranteed QoS, needed for exclusive CPUs under the static CPU manager)."""
    memory: str | None = None
    """Memory request = limit."""
    gpu_request: GpuRequest = "auto"
    """How pods get their GPUs: DRA claims, ``nvidia.com/gpu`` from the device plugin, or auto (DRA when pinnable)."""
    rdma_resource: str | None = None
    """RDMA resource of a disaggregated plan's pods (None: the fabric's, else ``rdma/hca_shared_devices_a``)."""
    mpi_ssh_secret: str | None = None
    """Secret with ``ssh-privatekey`` and ``ssh-publickey`` through which a multi-node TensorRT-LLM leader's
    mpirun reaches the worker pods (None: ``NAME_PREFIX-mpi-ssh``)."""
    dra_driver_version: str = DEFAULT_DRA_DRIVER
    """The NVIDIA DRA driver release the cluster runs: before v25.12.0 the GPUs are selected by UUID only
    (those releases publish no standard ``pciBusID``)."""
    scheduler: str = "default"
    """Whose scheduler admits the pods: ``default`` (kube-scheduler), ``kai``, ``kueue`` or ``volcano``
    (``k8s_schedulers.py``: the gang and topology objects and fields each one reads)."""
    queue: str | None = None
    """The scheduler's queue (None: ``k8s_schedulers.DEFAULT_QUEUES``)."""
    scheduler_topology: str = "cluster-topology"
    """KAI: the name of the cluster's ``Topology`` object the PodGroups' constraints refer to."""
    hf_token_secret: str | None = None
    """``NAME`` or ``NAME:KEY`` of the Secret whose key (default ``token``) becomes ``HF_TOKEN`` in the engine
    container: required when given; None refers to ``hf-token`` optionally, so a cluster without it still
    starts public models and one with it downloads gated ones (Llama) too."""
    model_cache: str | None = None
    """``pvc:NAME`` or ``host:/PATH`` mounted at ``MODEL_CACHE_DIR`` (the Hugging Face cache, ``HF_HOME``): a
    restarted pod loads the weights from there instead of downloading them again. None: the container's own
    disk (downloaded at every start)."""

    def __post_init__(self) -> None:
        if self.gpu_request not in GPU_REQUESTS:
            raise InputError(f"--gpu-request {self.gpu_request!r} is not one of {', '.join(GPU_REQUESTS)}")
        if self.mpi_ssh_secret is not None and not (
            len(self.mpi_ssh_secret) <= 253 and _DNS_SUBDOMAIN.match(self.mpi_ssh_secret)
        ):
            raise InputError(
                f"--ssh-secret {self.mpi_ssh_secret[:80]!r} is not a Secret name",
                fix="use lower-case letters, digits, '-' and '.' (a DNS subdomain), e.g. llm-mpi-ssh",
            )
        parse_driver_version(self.dra_driver_version)  # refuses what is not a release number
        if self.scheduler not in SCHEDULER_NAMES:
            raise InputError(f"--scheduler {self.scheduler[:40]!r} is not one of {', '.join(SCHEDULER_NAMES)}")
        for flag, value in (("--queue", self.queue), ("--scheduler-topology", self.scheduler_topology)):
            if value is not None and not (len(value) <= 253 and _DNS_SUBDOMAIN.match(value)):
                raise InputError(
                    f"{flag} {value[:80]!r} is not a Kubernetes object name",
                    fix="use lower-case letters, digits, '-' and '.' (a DNS subdomain)",
                )
        if self.hf_token_secret is not None:
            name, _, key = self.hf_token_secret.partition(":")
            if not (len(name) <= 253 and _DNS_SUBDOMAIN.match(name)) or (key and not _SECRET_KEY.match(key)):
                raise InputError(
                    f"--hf-token-secret {self.hf_token_secret[:80]!r} is not NAME or NAME:KEY of a Secret",
                    fix="e.g. --hf-token-secret hf-token (key 'token') or --hf-token-secret hf-token:HF_TOKEN",
                )
        if self.model_cache is not None:
            model_cache_volume(self.model_cache)  # refuses what is not pvc:NAME or host:/PATH
        if self.rdma_resource is not None:
            try:
                TypeAdapter(ResourceName).validate_python(self.rdma_resource)
            except ValidationError as exc:
                raise InputError(f"--rdma-resource: {first_problem(exc).msg}") from None

    @property
    def driver(self) -> tuple[int, int, int]:
        """``dra_driver_version`` as (major, minor, patch)."""
        return parse_driver_version(self.dra_driver_version)

    def ssh_secret(self) -> str:
        """The Secret a multi-node TensorRT-LLM instance's pods take their ssh key pair from."""
        return self.mpi_ssh_secret or dns_name(self.name_prefix, "mpi-ssh", limit=253)

    def check_image_version(self, priced: str | None) -> None:
        """Refuse an image whose tag names another version of the engine than the plan was priced for
        (``--engine-version``); a tag that is no version (``latest``, a digest) is the user's to vouch for."""
        image = self.image or DEFAULT_IMAGES[self.engine]
        if priced is None or image is None or "@" in image:
            return
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        try:
            running = engine_version(tag)
        except ValueError:
            return
        if running is not None and not (version_matches(priced, running) or version_matches(running, priced)):
            raise InputError(
                f"the plan is priced for {self.engine} {priced} but the image {image[:100]} runs {running}",
                fix=f"pass --image with a {priced} tag, or plan with --engine-version {running}",
            )

    def resolved_image(self) -> str:
        image = self.image or DEFAULT_IMAGES[self.engine]
        if not image:
            raise InputError(f"no default image for {self.engine}", fix="pass --image with a pinned tag")
        return image


def dns_name(*parts: str, limit: int = 52) -> str:
    """A DNS-1123 label from free text (LWS appends group and worker indices, so keep it short). A text longer
    than ``limit`` is cut and ends with 8 hex digits of a hash of the whole text, so two ids that differ only
    after the cut still name two objects."""
    joined = "-".join(parts)
    text = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", joined.lower())).strip("-")
    if len(text) > limit:
        digest = hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        text = text[: limit - 9].rstrip("-") + "-" + digest
    if not text:
        raise InputError(f"cannot make a Kubernetes name from {parts!r}")
    return text


def label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value or "none"


def object_metadata(name: str, opts: K8sOptions, doc: PlanDoc) -> Obj:
    return {
        "name": name,
        "namespace": opts.namespace,
        "labels": {**MANAGED_BY, LABEL_REQUEST: label_value(doc.request.id)},
    }


def check_k8s_node_names(doc: PlanDoc) -> None:
    """Every node a plan pins pods to must be one a Kubernetes node can be called: the kubelet registers
    lower-case names (DNS-1123 subdomain), so a pod pinned to ``GPU-A`` would stay Pending for ever.
    (Elsewhere toposched accepts upper case: hostnames outside Kubernetes are case-insensitive.)"""
    for p in doc.placements:
        for rank in p.ranks:
            if rank.node != rank.node.lower():
                raise InputError(
                    f"placement {p.id}: node {rank.node!r} cannot be a Kubernetes node name (lower case only: "
                    "the kubelet registers hostnames lower-cased), so its pods would stay Pending",
                    fix=f"name the node as `kubectl get nodes` shows it ({rank.node.lower()!r}) in the cluster "
                    "spec or probe, and plan again",
                )


def model_cache_volume(spec: str) -> Obj:
    """The volume of ``--model-cache pvc:NAME`` (a PersistentVolumeClaim) or ``host:/PATH`` (a hostPath directory,
    created if missing); InputError for anything else."""
    kind, _, value = spec.partition(":")
    if kind == "pvc" and len(value) <= 253 and _DNS_SUBDOMAIN.match(value):
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": value}}
    if kind == "host" and _HOST_PATH.match(value) and "/../" not in value + "/" and value != "/":
        return {"name": "model-cache", "hostPath": {"path": value, "type": "DirectoryOrCreate"}}
    raise InputError(
        f"--model-cache {spec[:80]!r} is not pvc:NAME or host:/PATH",
        fix="e.g. --model-cache pvc:llm-weights (a PersistentVolumeClaim) or --model-cache host:/data/hf-cache",
    )


def hf_token_env(opts: K8sOptions) -> Obj:
    """``HF_TOKEN`` from the Secret (``--hf-token-secret``), or optionally from ``hf-token``."""
    name, _, key = (opts.hf_token_secret or DEFAULT_HF_SECRET).partition(":")
    ref: Obj = {"name": name, "key": key or "token"}
    if opts.hf_token_secret is None:
        ref["optional"] = True
    return {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}

"""The real inputs the fuzzer starts from.

Captured outputs come from ``tests/data/fixtures`` (``topo/``, ``p2p/``, ``nvlink/``, ``nccl/``,
``model_configs/``); cluster specs, scenarios, traces and service bodies follow the examples in
docs/; plan documents are made by running ``toposched plan --json`` on presets and a two-node spec,
so they are exactly what a user would feed ``launch``. Everything is built once, on first use.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import FIXTURES, REPO

TOPO_FOR_SPECS = (
    "04_8x-h100-nv18-no-gpunumaid.txt",
    "07_dgx1-v100-1nic-driver440.txt",
    "16_8x-a100sxm4-80g-nv12-8nic-roce.txt",
    "22_8x-a100-nv12-10nic-nps4-mangled.txt",
    "34_2x-h100pcie-nvlink-bridge-nv12-indented6.txt",
)
"""Fixture captures used as ``smi:`` files of cluster-spec nodes."""


def fixture_files(*subdirs: str) -> list[tuple[str, bytes]]:
    """``(subdir/name, bytes)`` of every fixture file in ``subdirs``, sorted."""
    out: list[tuple[str, bytes]] = []
    for sub in subdirs:
        out += [(f"{sub}/{p.name}", p.read_bytes()) for p in sorted((FIXTURES / sub).iterdir()) if p.is_file()]
    return out


def package_file(*parts: str) -> Path:
    return Path(str(resources.files("toposched").joinpath(*parts)))


@cache
def model_configs() -> list[tuple[str, bytes]]:
    """Hugging Face config.json files: the fixtures, the catalog's copies and the 175B-class config."""
    seen: set[bytes] = set()
    out: list[tuple[str, bytes]] = []
    files = fixture_files("model_configs")
    files += [(f"data/models/{p.name}", p.read_bytes()) for p in sorted(package_file("data", "models").iterdir())]
    files.append(
        (
            "data/scenarios/dense-175b-class.json",
            package_file("data", "scenarios", "dense-175b-class.json").read_bytes(),
        )
    )
    for name, data in files:
        if data not in seen:
            seen.add(data)
            out.append((name, data))
    return out


def _cli_json(*args: str) -> Any:
    """Run ``toposched ARGS`` in-process and parse its JSON stdout."""
    from toposched.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(list(args))
    return json.loads(out.getvalue())


TWO_NODE_SPEC: dict[str, Any] = {
    "name": "two",
    "fabric": {"kind": "IB", "nic_gbps": 50, "nics_per_node": 8, "rail_optimized": True, "socket_ifname": "eth0"},
    "nodes": [
        {
            "name": "h100-{i:02d}",
            "count": 2,
            "preset": "hgx-h100",
            "rack": "rack0",
            "zone": "zone-a",
            "labels": {"pool": "prod"},
        },
    ],
}


@cache
def probe_json() -> dict[str, Any]:
    """A saved ``topo show --json`` of one HGX H100 (what a spec's ``probe:`` names)."""
    data: dict[str, Any] = _cli_json("topo", "show", "--preset", "hgx-h100", "--json")
    return data


@cache
def plans() -> list[tuple[str, dict[str, Any]]]:
    """Plan documents from ``toposched plan --json``: single node, two replicas, multi-node, PCIe."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "two.yaml"
        spec.write_text(yaml.safe_dump(TWO_NODE_SPEC))
        runs = {
            "plan-hgx-h100-70b-x2.json": ("--preset", "hgx-h100", "--model", "llama-3.1-70b", "--replicas", "2"),
            "plan-two-node-405b.json": ("--cluster", str(spec), "--model", "llama-3.1-405b"),
            "plan-dgx-a100-8b-x3.json": ("--preset", "dgx-a100", "--model", "llama-3.1-8b", "--replicas", "3"),
            "plan-l40s-mixtral-fp8.json": (
                "--preset",
                "l40s-8x-pcie",
                "--model",
                "mixtral-8x7b",
                "--weight-dtype",
                "fp8",
                "--kv-dtype",
                "fp8",
            ),
        }
        out = []
        for name, args in runs.items():
            doc = _cli_json("plan", *args, "--json")
            if doc.get("placements"):
                out.append((name, doc))
    if len(out) < 3:
        raise RuntimeError(f"making the seed plans failed: only {[n for n, _ in out]}")
    return out


@cache
def cluster_specs() -> list[tuple[str, dict[str, Any], tuple[tuple[str, bytes], ...]]]:
    """Cluster specs (as documents) and the files they refer to (an smi capture, a saved probe)."""
    topo = FIXTURES / "topo"
    extras = (
        ("topo/gpu-21.txt", (topo / TOPO_FOR_SPECS[2]).read_bytes()),
        ("probes/gpu-22.json", json.dumps(probe_json()).encode()),
    )
    docs_example = {
        "name": "prod-east",
        "fabric": {"kind": "IB", "nic_gbps": 50, "nics_per_node": 8, "rail_optimized": True, "socket_ifname": "eth0"},
        "nodes": [
            {"name": "h100-{i:02d}", "count": 4, "preset": "hgx-h100", "rack": "rack0", "zone": "zone-a"},
            {
                "name": "gpu-21",
                "smi": "topo/gpu-21.txt",
                "gpu_model": "NVIDIA A100-SXM4-80GB",
                "hbm_gib": 80,
                "labels": {"pool": "batch"},
            },
            {"name": "gpu-22", "probe": "probes/gpu-22.json"},
        ],
        "cliques": [{"id": "nvl-a", "nodes": ["h100-00", "h100-01"], "bandwidth_gbps": 900}],
    }
    smi_nodes = {
        "name": "captures",
        "nodes": [{"name": f"cap-{k}", "smi": f"topo/{name}"} for k, name in enumerate(TOPO_FOR_SPECS)],
    }
    smi_extras = tuple((f"topo/{name}", (topo / name).read_bytes()) for name in TOPO_FOR_SPECS)
    mixed = {
        "version": 1,
        "name": "mixed",
        "nodes": [
            {"name": "b200-{i}", "count": 2, "preset": "hgx-b200", "rack": "r1", "zone": "z1"},
            {"name": "dgx1", "preset": "dgx1-v100", "labels": {"topology.kubernetes.io/zone": "z2"}},
            {"name": "l40s.example.com", "preset": "l40s-8x-pcie"},
        ],
        "cliques": [{"id": "pair", "nodes": ["b200-0", "b200-1"]}],
    }
    return [
        ("docs-example.yaml", docs_example, extras),
        ("two-node.yaml", TWO_NODE_SPEC, ()),
        ("captures.yaml", smi_nodes, smi_extras),
        ("mixed.json", mixed, ()),
    ]


def trace_csv(rows: int = 30) -> bytes:
    """A request trace (``timestamp,model,input_len,output_len,slo_class``)."""
    classes = ("realtime", "interactive", "standard", "batch")
    lines = ["timestamp,model,input_len,output_len,slo_class"]
    lines += [f"{i * 0.25:.2f},llama-3.1-8b,{128 + 37 * i},{16 + 5 * i},{classes[i % 4]}" for i in range(rows)]
    return ("\n".join(lines) + "\n").encode()


def traces() -> list[tuple[str, bytes]]:
    plain = trace_csv()
    return [
        ("trace.csv", plain),
        ("trace-crlf.csv", plain.replace(b"\n", b"\r\n")),
        ("trace-quoted.csv", b'timestamp,model,input_len,output_len,slo_class,extra\n"0.5","m",10,"20",batch,x\n'),
    ]


@cache
def scenarios() -> list[tuple[str, dict[str, Any], tuple[tuple[str, bytes], ...]]]:
    """Scenario documents: the built-ins (paths made relative) and ones with a trace and a spec."""
    from toposched.sim.builtin_scenarios import SCENARIOS

    dense = package_file("data", "scenarios", "dense-175b-class.json").read_bytes()
    out: list[tuple[str, dict[str, Any], tuple[tuple[str, bytes], ...]]] = []
    for name in SCENARIOS.names():
        doc = SCENARIOS.get(name).model_dump(mode="json")
        extras: tuple[tuple[str, bytes], ...] = ()
        if str(doc["model"]).endswith(".json"):
            doc["model"], extras = "model.json", (("model.json", dense),)
        out.append((f"{name}.yaml", doc, extras))
    out.append(
        (
            "traced.yaml",
            {
                "name": "traced",
                "cluster": "2xhgx-h100",
                "model": "llama-3.1-8b",
                "trace": "trace.csv",
                "batch": 8,
                "slo_ms": 50,
                "failures": [{"at_s": 1.0, "gpu": "hgx-h100-0/1", "kind": "nvlink-down"}],
            },
            (("trace.csv", trace_csv()),),
        )
    )
    out.append(
        (
            "on-spec.yaml",
            {
                "name": "on-spec",
                "cluster": "cluster.yaml",
                "model": "llama-3.1-8b",
                "requests": 20,
                "arrivals": {
                    "kind": "bursty",
                    "rate_per_s": 5,
                    "burst_factor": 3,
                    "burst_every_s": 4,
                    "burst_length_s": 1,
                },
                "slo_mix": {"realtime": 0.2, "batch": 0.8},
                "instances": 2,
                "autoscale": False,
            },
            (("cluster.yaml", yaml.safe_dump(TWO_NODE_SPEC).encode()),),
        )
    )
    return out


PLACE_BODIES: tuple[dict[str, Any], ...] = (
    {"model": "llama-3.1-8b"},
    {"model": "llama-3.1-70b", "replicas": 2, "allowed_tp": [4], "ttl_s": 60, "id": "fuzz-a"},
    {
        "model": "mixtral-8x7b",
        "ep": 2,
        "allowed_tp": [2],
        "expert_replicas": 2,
        "expert_hit_rates": [0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05],
    },
    {
        "model": "llama-3.1-8b",
        "node_selector": {"pool": "prod"},
        "racks": ["rack0"],
        "zones": ["zone-a"],
        "spread_replicas": True,
        "replicas": 2,
        "near": "fuzz-a",
        "near_level": "node",
    },
    {
        "model": "llama-3.1-8b",
        "slo_tpot_ms": 40,
        "slo_ttft_ms": 500,
        "slo_class": "realtime",
        "priority": 5,
        "weight_dtype": "fp8",
        "kv_dtype": "fp8",
        "max_model_len": 4096,
        "input_len": 1024,
        "output_len": 128,
        "concurrent_seqs": 4,
        "affinity": "nvlink",
        "policy": "latency",
        "wait_s": 0.1,
        "allow_int4_kv": False,
    },
)
"""Request bodies for ``POST /v1/placements`` covering every field."""


def _pod(gpus: Any, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "default", **meta},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus}}}]},
    }


EXTENDER_BODIES: tuple[dict[str, Any], ...] = (
    {
        "Pod": _pod("4"),
        "Nodes": {
            "kind": "NodeList",
            "apiVersion": "v1",
            "items": [{"metadata": {"name": "h100-00"}}, {"metadata": {"name": "elsewhere"}}],
        },
        "NodeNames": None,
    },
    {"Pod": _pod("8"), "NodeNames": ["h100-00", "h100-01"]},
    {"Pod": _pod(1, labels={"toposched.io/placement": "fuzz-a"}), "NodeNames": ["h100-00", "other"]},
    {"Pod": _pod("16", annotations={"toposched.io/placement": "ghost"}), "NodeNames": ["h100-01"]},
    {
        "pod": {
            "metadata": {"name": "web"},
            "spec": {"containers": [{"name": "c"}], "initContainers": [{"name": "i"}]},
        },
        "nodenames": ["a", "b"],
    },
)
"""kube-scheduler ExtenderArgs (Go spelling and lower case), with and without a placement label."""

REPORT_BODIES: tuple[dict[str, Any], ...] = (
    {
        "placement": "fuzz-a-0",
        "node": "h100-00",
        "cycle": 3,
        "cpu_seconds": 0.01,
        "new_alerts": [
            {
                "kind": "TOPOLOGY_DRIFT",
                "gpu": "h100-00/1",
                "subject": "nvlink",
                "observed": 0,
                "expected": 18,
                "message": "links down",
            }
        ],
        "active_alerts": [{"kind": "HBM_DRIFT", "gpu": "h100-00/1", "observed": 70.5, "expected": 60}],
    },
    {"placement": "nobody", "active_alerts": [{"kind": "PCIE_BUDGET_WARNING", "gpu": "h100-01/7"}]},
)
"""Sidecar reports (``POST /v1/reports``)."""

K8S_NODES = REPO / "tests" / "binding" / "data" / "nodes-h100.json"
"""``kubectl get nodes -o json`` of three HGX H100 nodes (the k8s-lint input)."""

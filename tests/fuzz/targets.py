"""The fuzz targets: every parser of user input, through the entry point the CLI or service calls.

Each target first calls the library entry point (only ``ToposchedError`` may escape), then, when
the input was accepted, the CLI commands that consume it in-process (``toposched.cli.main.main``,
which turns ``ToposchedError`` into an exit code, so anything but ``SystemExit`` is a traceback the
user would see). ``TARGETS`` lists them all; ``cliargs.py``, ``inject.py`` and ``service.py`` add
the CLI-flag, launch-script and HTTP targets.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from tests.fuzz import seeds
from tests.fuzz.harness import Case, Target
from tests.fuzz.mutate import YAML_BOMB, mutate_bytes, mutate_doc, serialise
from toposched.errors import ToposchedError

CLI_OK: tuple[type[BaseException], ...] = (ToposchedError, SystemExit)
"""What may leave a target that also runs CLI commands: a user error, or the CLI's exit."""

HOSTILE_PATHS: tuple[str, ...] = (
    ".",
    "..",
    "/",
    "/dev/zero",
    "/dev/null",
    "/proc/self/status",
    "/nonexistent/x",
    "big.txt",
    "folder",
    "folder/",
    "link-loop",
    "~",
    "-",
    "",
)
"""Paths a user (or a spec, scenario or plan) may name: special files, folders, a 17 MiB file."""


def cli(*args: str | Path) -> int:
    """Run ``toposched ARGS`` in-process (stdout/stderr discarded); its exit code."""
    from toposched.cli.main import main

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
    return 0


@contextlib.contextmanager
def chdir(folder: Path) -> Iterator[None]:
    """Relative paths in the input resolve inside the case folder (nothing lands in the repo)."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def add_hostile_files(folder: Path) -> None:
    """The files HOSTILE_PATHS name relative to the case folder."""
    with open(folder / "big.txt", "wb") as fh:
        fh.truncate(17 * 1024 * 1024)  # sparse: larger than any input toposched reads
    (folder / "folder").mkdir(exist_ok=True)
    with contextlib.suppress(OSError):
        os.symlink("link-loop", folder / "link-loop")


# ------------------------------------------------------------------------------------------ strategies


def file_cases(
    files: Sequence[tuple[str, bytes]], name: str, extras: tuple[tuple[str, bytes], ...] = ()
) -> Callable[[], st.SearchStrategy[Case]]:
    """Byte/line mutations of the seed files."""

    def build() -> st.SearchStrategy[Case]:
        datas = [d for _, d in files]

        @st.composite
        def case(draw: Any) -> Case:
            label, data = files[draw(st.integers(0, len(files) - 1))]
            return Case(mutate_bytes(draw, data, datas), name, extras, seed=label)

        return case()

    return build


def file_seeds(
    files: Sequence[tuple[str, bytes]], name: str, extras: tuple[tuple[str, bytes], ...] = ()
) -> Callable[[], list[Case]]:
    return lambda: [Case(data, name, extras, seed=label) for label, data in files]


Docs = Sequence[tuple[str, Any, tuple[tuple[str, bytes], ...]]]


def doc_cases(docs: Callable[[], Docs], fmt: str, name: Callable[[str], str]) -> Callable[[], st.SearchStrategy[Case]]:
    """Structural mutations of seed documents, written as JSON or YAML, sometimes damaged as bytes too."""

    def build() -> st.SearchStrategy[Case]:
        items = list(docs())

        @st.composite
        def case(draw: Any) -> Case:
            label, doc, extras = items[draw(st.integers(0, len(items) - 1))]
            if fmt != "json" and draw(st.integers(0, 30)) == 0:
                return Case(YAML_BOMB, name("x.yaml"), extras, seed="yaml-bomb")
            mutated = mutate_doc(draw, doc, yaml_too=fmt != "json")
            data = serialise(draw, mutated, fmt)
            if draw(st.integers(0, 3)) == 0:
                data = mutate_bytes(draw, data, [], max_ops=2)
            return Case(data, name(label), extras, seed=label)

        return case()

    return build


def doc_seeds(docs: Callable[[], Docs], name: Callable[[str], str]) -> Callable[[], list[Case]]:
    def build() -> list[Case]:
        out = []
        for label, doc, extras in docs():
            text = json.dumps(doc) if label.endswith(".json") else yaml.safe_dump(doc, sort_keys=False)
            out.append(Case(text.encode(), name(label), extras, seed=label))
        return out

    return build


# ------------------------------------------------------------------------------------------ entries


def run_smi(case: Case, folder: Path) -> None:
    from toposched.cli.topo import topology_json
    from toposched.topology.domains import build_domain_map
    from toposched.topology.sources import SourceRef, load_source

    path = folder / case.name
    loaded = load_source(SourceRef(kind="smi", ref=str(path)))
    json.dumps(topology_json(loaded.cluster, build_domain_map(loaded.cluster), source="fuzz"))
    cli("topo", "show", "--smi", path)
    cli("verify", "topo", "--smi", path, "--gpus", "0,1")
    cli("allocate", "--smi", path, "--size", "2", "--json", "--explain")


def run_nccl(case: Case, folder: Path) -> None:
    from toposched.sidecar.nccl import read_nccl_file

    path = folder / case.name
    json.dumps(read_nccl_file(path).to_json())
    cli("verify", "nccl", path)


def run_nvlink(case: Case, folder: Path) -> None:
    from toposched.topology.nvml import probe_node
    from toposched.topology.nvml_fake import FakeNvml

    status = (folder / case.name).read_bytes().decode("utf-8", "replace")
    remote = (folder / "remote.txt").read_bytes().decode("utf-8", "replace")
    probe_node(FakeNvml.from_nvlink_text(status, remote), hostname="fuzz")


def nvlink_cases() -> st.SearchStrategy[Case]:
    """``nvidia-smi nvlink -s`` and ``-R`` captures, one of the two damaged."""
    status, remote = _nvlink_pair()
    texts = [status, remote]

    @st.composite
    def case(draw: Any) -> Case:
        damaged = draw(st.booleans())
        s = mutate_bytes(draw, status, texts) if damaged else status
        r = remote if damaged else mutate_bytes(draw, remote, texts)
        # A capture names one machine's GPUs; 64 KiB is about 60 GPUs (probing is pairwise, so a
        # megabyte of repeated GPUs is slow by nature, and this reader only feeds test machines).
        return Case(s[:NVLINK_MAX], "status.txt", (("remote.txt", r[:NVLINK_MAX]),), seed="nvlink/02+03")

    return case()


NVLINK_MAX = 64 * 1024


def _nvlink_pair() -> tuple[bytes, bytes]:
    files = dict(seeds.fixture_files("nvlink"))
    return (
        files["nvlink/02_2x-h100pcie-bridge-nvlink-s-inactive-indented6.txt"],
        files["nvlink/03_2x-h100pcie-bridge-nvlink-R-remote-indented6.txt"],
    )


def run_cluster_spec(case: Case, folder: Path) -> None:
    from toposched.topology.domains import build_domain_map
    from toposched.topology.sources import SourceRef, load_source

    path = folder / case.name
    add_hostile_files(folder)
    with chdir(folder):
        loaded = load_source(SourceRef(kind="cluster", ref=str(path)))
        build_domain_map(loaded.cluster)
        cli("topo", "show", "--cluster", path)
        if loaded.cluster.gpu_count <= 512:
            cli("plan", "--cluster", path, "--model", "llama-3.1-70b", "--replicas", "2", "--json")


def run_probe(case: Case, folder: Path) -> None:
    from toposched.topology.sources import SourceRef, load_source

    load_source(SourceRef(kind="cluster", ref=str(folder / "spec.yaml")))
    cli("topo", "show", "--cluster", folder / "spec.yaml", "--json")


def run_model_config(case: Case, folder: Path) -> None:
    from toposched.perf.hardware import get_gpu
    from toposched.perf.latency import predict_latency
    from toposched.perf.links import get_link
    from toposched.workload.catalog import resolve_model
    from toposched.workload.memory import estimate_memory
    from toposched.workload.parallel import valid_tps

    path = str(folder / case.name)
    spec = resolve_model(path)
    gpu, link = get_gpu("H100-SXM"), get_link("nvlink4")
    for tp in valid_tps(spec)[:2]:
        estimate_memory(spec, gpu_memory_bytes=gpu.memory_bytes, tp=tp)
        predict_latency(spec, gpu, tp=tp, link=link, pp_link=link, batch=8, input_len=512, output_len=64)
    cli("fit", "--model", path, "--gpu", "H100-SXM", "--json")
    cli("plan", "--preset", "hgx-h100", "--model", path, "--json")


def run_scenario(case: Case, folder: Path) -> None:
    from toposched.sim.deployment import placement_template
    from toposched.sim.loading import load_cluster, load_scenario
    from toposched.sim.run import make_arrivals
    from toposched.sim.scenario import expected_instance_arrivals
    from toposched.workload.catalog import resolve_model

    path = folder / case.name
    add_hostile_files(folder)
    with chdir(folder):
        sc = load_scenario(str(path))
        cluster = load_cluster(sc.cluster)
        for tenant in sc.tenant_list():
            resolve_model(tenant.model)
            placement_template(tenant, tenant.slo_ms)
        make_arrivals(sc.model_copy(update={"requests": min(sc.request_count, 200)}), 0)
        # a churn run's work grows with its instance arrivals (one GPU each: the most there can be)
        small_churn = sc.churn is None or (
            expected_instance_arrivals(sc.churn, cluster.gpu_count, 1.0, sc.instance_startup_s) <= 500
        )
        if cluster.gpu_count <= 32 and small_churn:
            cli("simulate", "--scenario", path, "--policies", "slo", "--requests", "12", "--json")


def run_trace(case: Case, folder: Path) -> None:
    from toposched.sim.run import read_trace

    read_trace(str(folder / case.name))


def run_plan(case: Case, folder: Path) -> None:
    from toposched.binding.plan_doc import load_plan

    path = folder / case.name
    doc = load_plan(path)
    for engine in ("vllm", "sglang"):
        cli("launch", engine, "--plan", path)
    cli("launch", "k8s", "--plan", path)
    cli("launch", "k8s", "--plan", path, "--kubelet")
    cli("launch", "ray", "--plan", path)
    cli("launch", "k8s-lint", "--nodes", seeds.K8S_NODES, "--plan", path, "--json")
    first = doc.placements[0]
    cli(
        "sidecar",
        "--placement",
        first.id,
        "--plan",
        path,
        "--fake",
        "link-down",
        "--iterations",
        "2",
        "--interval",
        "0.001",
        "--react",
    )


def run_k8s_nodes(case: Case, folder: Path) -> None:
    cli("launch", "k8s-lint", "--nodes", folder / case.name, "--plan", folder / "plan.json", "--json")


def run_ledger(case: Case, folder: Path) -> None:
    url = f"sqlite:{folder / case.name}"
    cli("ledger", "show", "--state", url, "--json", "--audit")
    cli("ledger", "release", "fuzz-a", "--state", url, "--json")


# --------------------------------------------------------------------------------------------- seeds


@cache
def plan_bytes() -> bytes:
    return json.dumps(seeds.plans()[0][1]).encode()


@cache
def _two_node_plan() -> bytes:
    return json.dumps(dict(seeds.plans())["plan-two-node-405b.json"]).encode()


def _topo_files() -> list[tuple[str, bytes]]:
    return seeds.fixture_files("topo", "p2p", "nvlink")


def _nccl_files() -> list[tuple[str, bytes]]:
    return seeds.fixture_files("nccl")


def _configs() -> Docs:
    return [(name, json.loads(data), ()) for name, data in seeds.model_configs()]


def _plans() -> Docs:
    return [(name, doc, ()) for name, doc in seeds.plans()]


def _probes() -> Docs:
    spec = b"name: probed\nnodes:\n  - {name: gpu-22, probe: probe.json}\n"
    return [("probe.json", seeds.probe_json(), (("spec.yaml", spec),))]


def _nodes_docs() -> Docs:
    return [("nodes-h100.json", json.loads(seeds.K8S_NODES.read_text()), (("plan.json", _two_node_plan()),))]


@cache
def _ledger_files() -> list[tuple[str, bytes]]:
    """A SQLite ledger with capacity and two reservations, as bytes (made by the code)."""
    import tempfile

    from toposched.ledger import open_ledger

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.sqlite3"
        ledger = open_ledger(f"sqlite:{path}")
        ledger.set_capacity({f"h100-00/{i}": 80 << 30 for i in range(8)})
        ledger.reserve("fuzz-a", {"h100-00/0": 40 << 30, "h100-00/1": 40 << 30}, ttl_s=3600, owner="fuzz")
        ledger.reserve("fuzz-b", {"h100-00/2": 70 << 30})
        ledger.release("fuzz-b")
        ledger.close()
        return [("state.sqlite3", path.read_bytes())]


def _same(name: str) -> Callable[[str], str]:
    return lambda _label: name


def _spec_name(label: str) -> str:
    return "spec.json" if label.endswith(".json") else "spec.yaml"


TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    if target.name in TARGETS:
        raise ValueError(f"fuzz target {target.name} registered twice")
    TARGETS[target.name] = target
    return target


register(
    Target(
        "smi",
        "load_source(smi) + topo show / verify topo / allocate --smi",
        cases=file_cases(_topo_files(), "topo.txt"),
        seeds=file_seeds(_topo_files(), "topo.txt"),
        run=run_smi,
        allowed=CLI_OK,
        brief_examples=20,
    )
)
register(
    Target(
        "nccl",
        "read_nccl_file + verify nccl",
        cases=file_cases(_nccl_files(), "nccl.log"),
        seeds=file_seeds(_nccl_files(), "nccl.log"),
        run=run_nccl,
        allowed=CLI_OK,
        brief_examples=25,
    )
)
register(
    Target(
        "nvlink-capture",
        "FakeNvml.from_nvlink_text (nvlink -s / -R captures) + probe_node",
        cases=nvlink_cases,
        seeds=lambda: [Case(_nvlink_pair()[0], "status.txt", (("remote.txt", _nvlink_pair()[1]),), seed="nvlink")],
        run=run_nvlink,
        brief_examples=15,
    )
)
register(
    Target(
        "cluster-spec",
        "load_source(cluster) (YAML and JSON) + topo show / plan --cluster",
        cases=doc_cases(seeds.cluster_specs, "any", _spec_name),
        seeds=doc_seeds(seeds.cluster_specs, _spec_name),
        run=run_cluster_spec,
        allowed=CLI_OK,
        brief_examples=25,
    )
)
register(
    Target(
        "cluster-probe",
        "a spec's probe: JSON (saved topo show --json)",
        cases=doc_cases(_probes, "json", _same("probe.json")),
        seeds=doc_seeds(_probes, _same("probe.json")),
        run=run_probe,
        allowed=CLI_OK,
        brief_examples=15,
    )
)
register(
    Target(
        "model-config",
        "resolve_model(config.json) + fit / plan --model",
        cases=doc_cases(_configs, "json", _same("config.json")),
        seeds=doc_seeds(_configs, _same("config.json")),
        run=run_model_config,
        allowed=CLI_OK,
        brief_examples=20,
    )
)
register(
    Target(
        "scenario",
        "load_scenario + load_cluster + make_arrivals + simulate",
        cases=doc_cases(seeds.scenarios, "yaml", _same("scenario.yaml")),
        seeds=doc_seeds(seeds.scenarios, _same("scenario.yaml")),
        run=run_scenario,
        allowed=CLI_OK,
        brief_examples=20,
    )
)
register(
    Target(
        "trace-csv",
        "read_trace (simulator CSV trace)",
        cases=file_cases(seeds.traces(), "trace.csv"),
        seeds=file_seeds(seeds.traces(), "trace.csv"),
        run=run_trace,
        brief_examples=25,
    )
)
register(
    Target(
        "plan-json",
        "load_plan + launch vllm/sglang/k8s/ray/k8s-lint + sidecar --fake",
        cases=doc_cases(_plans, "json", _same("plan.json")),
        seeds=doc_seeds(_plans, _same("plan.json")),
        run=run_plan,
        allowed=CLI_OK,
        brief_examples=12,
    )
)
register(
    Target(
        "k8s-nodes",
        "launch k8s-lint --nodes (kubectl get nodes -o json)",
        cases=doc_cases(_nodes_docs, "json", _same("nodes.json")),
        seeds=doc_seeds(_nodes_docs, _same("nodes.json")),
        run=run_k8s_nodes,
        allowed=CLI_OK,
        brief_examples=15,
    )
)
register(
    Target(
        "ledger-sqlite",
        "ledger show/release on a damaged SQLite state file",
        cases=lambda: file_cases(_ledger_files(), "state.sqlite3")(),
        seeds=lambda: file_seeds(_ledger_files(), "state.sqlite3")(),
        run=run_ledger,
        allowed=CLI_OK,
        brief_examples=10,
    )
)


def _late_targets() -> None:
    """The CLI-argument, launch-script and HTTP targets live in their own modules; importing registers them."""
    from tests.fuzz import cliargs, inject, service  # noqa: F401


_late_targets()

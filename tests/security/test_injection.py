"""Hostile names through every entry: a tampered plan JSON, a cluster spec and the API (issue 13 items 1-3, 15).

Every hostile value either stops the command with a clear error (exit code 2; an ``error:`` line naming the input
and at most a ``fix:`` line; no traceback; nothing written) or reaches a script verbatim, and that script, run
with ``vllm``/``python3``/``numactl`` replaced by stubs that record their arguments and environment, runs nothing
injected (no ``pwned`` file appears anywhere) and nothing is written outside ``--out``. Valid values of each
field are run the same way, so the harness is shown to execute the scripts it checks.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml

from tests.conftest import CliResult, RunCli
from toposched.names import id_problem, label_problem, label_value_problem, node_name_problem, word_problem
from toposched.topology.model import socket_ifname_problem

MARK = "pwned"
HOSTILE: dict[str, str] = {
    "newline": f"x\ntouch {MARK} #",
    "carriage-return": f"x\rtouch {MARK} #",
    "trailing-newline": "plan\n",
    "command-substitution": f"$(touch {MARK})",
    "backticks": f"`touch {MARK}`",
    "single-quotes": f"a'; touch {MARK}; '",
    "double-quotes": f'a"; touch {MARK}; "',
    "space-semicolon": f"a b; touch {MARK}",
    "dot-dot-slash": "../../escape",
    "slash": "x/y",
    "colon": "node:1",
    "leading-dash": "--headless",
    "10kB": "a" * 10_000,
    "nul": "a\x00b",
    "unicode": "nöde-ü",
    "line-separator": f"a\u2028touch {MARK}",
    "empty": "",
}

# The multi-node plan: TP8 x PP2 over two HGX H100 nodes (NCCL_IB_HCA, --master-addr, --dist-init-addr).
TWO_NODES = {
    "name": "two",
    "fabric": {"kind": "IB", "nics_per_node": 8, "rail_optimized": True, "socket_ifname": "eth0"},
    "nodes": [{"name": "h100-{i:02d}", "count": 2, "preset": "hgx-h100", "rack": "rack0"}],
}
MULTI = ["--model", "llama-3.1-405b", "--slo-tpot-ms", "60"]
STUB = """#!/bin/sh
call=$(mktemp "$STUB_DIR/call.XXXXXX")
printf '%s\\0' "$(basename "$0")" "$@" > "$call.argv"
env -0 > "$call.env"
"""

Plan = dict[str, Any]


def _head(plan: Plan) -> str:
    return str(next(r["node"] for r in plan["placements"][0]["ranks"] if r["rank"] == 0))


def _node(plan: Plan, name: str) -> dict[str, Any]:
    return next(n for n in plan["cluster"]["nodes"] if n["name"] == name)


def set_placement_id(plan: Plan, value: str) -> None:
    plan["placements"][0]["id"] = value


def set_request_id(plan: Plan, value: str) -> None:
    plan["request"]["id"] = value
    for p in plan["placements"]:
        p["request_id"] = value
        p["id"] = value  # one replica: the instance id is the request id


def set_node_name(plan: Plan, value: str) -> None:
    old = _head(plan)
    _node(plan, old)["name"] = value
    for p in plan["placements"]:
        for r in p["ranks"]:
            if r["node"] == old:
                r["node"] = value


def set_nic_device(plan: Plan, value: str) -> None:
    _node(plan, _head(plan))["nics"][0]["device"] = value


def set_socket_ifname(plan: Plan, value: str) -> None:
    plan["cluster"]["fabric"]["socket_ifname"] = value


def set_rack(plan: Plan, value: str) -> None:
    _node(plan, _head(plan))["rack"] = value


def set_label(plan: Plan, value: str) -> None:
    _node(plan, _head(plan))["labels"] = {"pool": value}


def set_gpu_uuid(plan: Plan, value: str) -> None:
    for n in plan["cluster"]["nodes"]:
        n["source"] = "nvml"  # UUIDs are what CUDA_VISIBLE_DEVICES lists for NVML topologies
    _node(plan, _head(plan))["gpus"][0]["uuid"] = value


def set_request_model(plan: Plan, value: str) -> None:
    plan["request"]["model"] = value


Rule = Callable[[object], "str | None"]

# field -> (how to put a value there, a valid value, the name rule that decides what is refused; None: free text)
FIELDS: dict[str, tuple[Callable[[Plan, str], None], str, Rule | None]] = {
    "placement-id": (set_placement_id, "plan", id_problem),
    "request-id": (set_request_id, "req-7.a_b", id_problem),
    "node-name": (set_node_name, "gpu-node-07.example", node_name_problem),
    "nic-device": (set_nic_device, "mlx5_bond_0", word_problem),
    "socket-ifname": (set_socket_ifname, "eth0", socket_ifname_problem),
    "rack": (set_rack, "rack-9", label_problem),
    "label": (set_label, "batch", label_value_problem),
    "gpu-uuid": (set_gpu_uuid, "GPU-0a1b2c3d", label_problem),
    # a catalog name or a path: unknown names are refused, anything accepted is one quoted argument
    "request-model": (set_request_model, "llama-3.1-405b", None),
}


@pytest.fixture(scope="module", autouse=True)
def _one_click_command() -> Iterator[None]:
    """Build the CLI's click command once for this module: typer rebuilds it on every call (~50 ms each),
    which is most of the time of ~400 in-process CLI runs. ``main()`` and its error handling are unchanged."""
    import typer.main

    build = typer.main.get_command
    built: dict[int, Any] = {}

    def cached(app: Any) -> Any:
        if id(app) not in built:
            built[id(app)] = build(app)
        return built[id(app)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(typer.main, "get_command", cached)
        yield


@pytest.fixture(scope="module")
def multi_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """``toposched plan --cluster two-nodes.yaml ... --json``: one placement over both nodes."""
    from toposched.cli.main import main

    spec = tmp_path_factory.mktemp("spec") / "two-nodes.yaml"
    spec.write_text(yaml.safe_dump(TWO_NODES))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["plan", "--cluster", str(spec), *MULTI, "--json"])
    plan: Plan = json.loads(buf.getvalue())
    assert len({r["node"] for p in plan["placements"] for r in p["ranks"]}) == 2
    return plan


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of fake engine binaries that record argv and environment into ``$STUB_DIR``."""
    folder = tmp_path_factory.mktemp("stubs")
    for name in ("vllm", "python3", "numactl", "nvidia-smi"):
        (folder / name).write_text(STUB)
        (folder / name).chmod(0o755)
    return folder


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def assert_clear_error(result: CliResult, names: str) -> None:
    """Exit code 2, ``error: ...`` naming ``names`` on one line, at most one ``fix:`` line, nothing on stdout."""
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout[:300])
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), result.stderr
    assert names in lines[0], result.stderr
    assert len(lines) == 1 or lines[1].startswith("  fix: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@contextlib.contextmanager
def stub_env(stubs: Path, calls: Path) -> Iterator[dict[str, str]]:
    calls.mkdir()
    yield {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_DIR": str(calls)}


def run_scripts(scripts: list[Path], stubs: Path, work: Path) -> list[tuple[list[str], dict[str, str]]]:
    """Run every script with the stubs first on PATH (cwd ``work``); the recorded (argv, env) of each call."""
    calls = work / "calls"
    with stub_env(stubs, calls) as env:
        for script in scripts:
            done = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, timeout=60)
            assert done.returncode == 0, done.stderr.decode(errors="replace")
    recorded = []
    for argv_file in sorted(calls.glob("*.argv")):
        argv = argv_file.read_bytes().decode().split("\0")[:-1]
        pairs = argv_file.with_suffix(".env").read_bytes().decode(errors="replace").split("\0")
        env = dict(p.split("=", 1) for p in pairs if "=" in p)
        recorded.append((argv, env))
    assert len(recorded) == len(scripts)
    return recorded


def each_case(check: Callable[[str, str], None]) -> None:
    """Run ``check(case, value)`` for every hostile value; fail with every case that failed, by name."""
    failed = []
    for case, value in HOSTILE.items():
        try:
            check(case, value)
        except Exception as exc:  # an assertion, or a traceback the CLI let through
            failed.append(f"{case}: {type(exc).__name__}: {str(exc)[:300]}")
    assert not failed, "\n".join(failed)


def launch_case(
    run_cli: RunCli, tmp_path: Path, stubs: Path, plan: Plan, engine: str, *extra: str
) -> tuple[CliResult, list[tuple[list[str], dict[str, str]]]]:
    """``toposched launch ENGINE --plan tampered.json --out DIR``; runs the scripts when it succeeds.

    Whatever happens, no ``pwned`` file may appear and every new file must be inside ``--out`` (or the
    stubs' call records).
    """
    work = tmp_path / "a" / "b" / "c" / "work"  # deep, so '../..' escapes still land under tmp_path
    work.mkdir(parents=True)
    path = work / "plan.json"
    path.write_text(json.dumps(plan))
    out = work / "out"
    before = files_under(tmp_path)
    cwd = Path.cwd()
    os.chdir(work)  # an injected relative `touch pwned` would land here
    try:
        result = run_cli("launch", engine, "--plan", str(path), "--out", str(out), *extra)
    finally:
        os.chdir(cwd)
    recorded: list[tuple[list[str], dict[str, str]]] = []
    if result.exit_code == 0:
        scripts = sorted(out.iterdir())
        assert scripts and all(s.suffix == ".sh" for s in scripts)
        recorded = run_scripts(scripts, stubs, work)
    new = files_under(tmp_path) - before
    outside = [p for p in new if out not in p.parents and work / "calls" not in p.parents]
    assert not outside, outside
    assert not list(tmp_path.rglob(f"{MARK}*")), "an injected command ran"  # `touch pwned` (or `pwned,` ...)
    return result, recorded


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_tampered_plan_json(run_cli: RunCli, tmp_path: Path, stubs: Path, multi_plan: Plan, field: str) -> None:
    setter, _, rule = FIELDS[field]

    def check(case: str, value: str) -> None:
        plan = copy.deepcopy(multi_plan)
        setter(plan, value)
        result, recorded = launch_case(run_cli, tmp_path / case, stubs, plan, "vllm")
        if rule is not None and rule(value):
            assert_clear_error(result, "plan.json: ")  # the file and the key path
        elif result.exit_code:
            assert_clear_error(result, "plan.json: " if rule is not None else "")
            assert rule is not None or "model" in result.stderr or value[:8] in result.stderr
        else:  # a value the rule accepts (':' in a NIC name, '/' in a label): the scripts ran, nothing injected
            assert len(recorded) == 2

    each_case(check)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_valid_values_reach_the_engines_verbatim(
    run_cli: RunCli, tmp_path: Path, stubs: Path, multi_plan: Plan, field: str, engine: str
) -> None:
    setter, value, _ = FIELDS[field]
    plan = copy.deepcopy(multi_plan)
    setter(plan, value)
    result, recorded = launch_case(run_cli, tmp_path, stubs, plan, engine)
    assert result.exit_code == 0, result.stderr
    assert len(recorded) == 2
    argvs = [argv for argv, _ in recorded]
    envs = [env for _, env in recorded]
    assert {a[0] for a in argvs} <= {"numactl", "vllm", "python3"}
    if field == "node-name":
        flag = "--master-addr" if engine == "vllm" else "--dist-init-addr"
        want = value if engine == "vllm" else f"{value}:20000"
        assert all(a[a.index(flag) + 1] == want for a in argvs)
    if field == "nic-device" and engine == "vllm":
        assert any(value in e["NCCL_IB_HCA"].removeprefix("=").split(",") for e in envs)
    if field == "socket-ifname":
        assert all(e["NCCL_SOCKET_IFNAME"] == value for e in envs)
    if field == "gpu-uuid":
        assert any(e["CUDA_VISIBLE_DEVICES"].split(",")[0] == value for e in envs)


def test_hostile_model_path_reaches_the_engine_verbatim(
    run_cli: RunCli, tmp_path: Path, stubs: Path, multi_plan: Plan
) -> None:
    """``--model-path`` is free text: it is quoted, never interpreted (or refused when it cannot be an argument)."""

    def check(case: str, value: str) -> None:
        result, recorded = launch_case(run_cli, tmp_path / case, stubs, multi_plan, "vllm", "--model-path", value)
        if not value.isprintable() or len(value) > 4096:  # a newline, NUL or line separator is no model path
            assert_clear_error(result, "--model-path")
            return
        assert result.exit_code == 0, result.stderr
        for argv, _ in recorded:
            assert argv[argv.index("serve") + 1] == (value or "meta-llama/Llama-3.1-405B")  # empty: the plan's

    each_case(check)


def test_degrees_of_a_tampered_plan(run_cli: RunCli, tmp_path: Path, multi_plan: Plan) -> None:
    """``tp: 0`` divided by zero before; negative, huge, fractional and string degrees are one line too."""
    cases: list[tuple[str, Any, str]] = [
        ("tp", 0, "placements.0.tp: tp=0"),
        ("tp", -8, "placements.0.tp: tp=-8"),
        ("pp", 0, "placements.0.pp: pp=0"),
        ("ep", 0, "placements.0.ep: ep=0"),
        ("ep", 10**6, "placements.0.ep: ep=1000000 is more than"),
        ("tp", 10**9, "placements.0.ranks: 16 ranks for tp=1000000000"),
        ("pp", 10**6, "placements.0.ranks: 16 ranks for tp=8 x pp=1000000"),
        ("tp", "8", "placements.0.tp: must be a whole number"),
        ("tp", 8.5, "placements.0.tp: must be a whole number"),
        ("tp", True, "placements.0.tp: must be a whole number"),
    ]
    for k, (key, value, message) in enumerate(cases):
        plan = copy.deepcopy(multi_plan)
        plan["placements"][0][key] = value
        path = tmp_path / f"plan-{k}.json"
        path.write_text(json.dumps(plan))
        assert_clear_error(run_cli("launch", "sglang", "--plan", str(path)), f"plan-{k}.json: {message}")
    mangles: list[Callable[[Plan], object]] = [
        lambda p: p["placements"][0]["ranks"].pop(),  # 15 ranks for tp=8 x pp=2
        lambda p: p["placements"][0]["ranks"][1].update(rank=0),  # rank 0 twice
        lambda p: p["placements"][0]["ranks"][1].update(gpu=p["placements"][0]["ranks"][0]["gpu"]),  # one GPU, 2 ranks
        lambda p: p["placements"][0]["ranks"][3].update(stage=1),  # rank 3 of tp=8 is in stage 0
    ]
    for k, mangle in enumerate(mangles):
        plan = copy.deepcopy(multi_plan)
        mangle(plan)
        path = tmp_path / f"ranks-{k}.json"
        path.write_text(json.dumps(plan))
        assert_clear_error(run_cli("launch", "sglang", "--plan", str(path)), f"ranks-{k}.json: placements.0.ranks")


def test_colon_in_a_node_name_of_a_multi_node_plan(run_cli: RunCli, tmp_path: Path, multi_plan: Plan) -> None:
    """Issue 13 item 15: ``launch k8s`` took the text after ':' in --master-addr as a port (ValueError)."""
    plan = copy.deepcopy(multi_plan)
    set_node_name(plan, "h100-00:8000")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    for command in (["k8s"], ["k8s", "--kubelet"], ["ray"], ["vllm"], ["sglang"]):
        result = run_cli("launch", *command, "--plan", str(path))
        assert_clear_error(result, "plan.json: cluster.nodes.")
        assert "'h100-00:8000' is not a hostname" in result.stderr


def test_script_names_stay_inside_out(run_cli: RunCli, tmp_path: Path, multi_plan: Plan) -> None:
    """A link planted in --out is not followed; a 253-character node name still gets a file name."""
    plan = copy.deepcopy(multi_plan)
    long_name = ".".join(["n" * 63] * 3 + ["x" * 61])
    set_node_name(plan, long_name)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    out = tmp_path / "out"
    result = run_cli("launch", "vllm", "--plan", str(path), "--out", str(out))
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 2 and all(len(n.encode()) <= 255 and n.endswith(".sh") for n in names)
    # plant a link where the next script goes: the write must be refused, not follow it out of --out
    target = tmp_path / "outside.sh"
    target.write_text("untouched")
    victim = out / names[0]
    victim.unlink()
    victim.symlink_to(target)
    result = run_cli("launch", "vllm", "--plan", str(path), "--out", str(out))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert target.read_text() == "untouched"


# --- cluster spec ---------------------------------------------------------------------------------


def _spec(tmp_path: Path, node: dict[str, Any], **top: Any) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"nodes": [{"preset": "hgx-h100", **node}], **top}))
    return path


# field -> (the spec's node entry and top-level keys holding a value, the rule that decides what is refused)
SPEC_FIELDS: dict[str, tuple[Callable[[str], tuple[dict[str, Any], dict[str, Any]]], Rule]] = {
    "node-name": (lambda v: ({"name": v}, {}), node_name_problem),
    "rack": (lambda v: ({"name": "gpu-0", "rack": v}, {}), label_problem),
    "label": (lambda v: ({"name": "gpu-0", "labels": {"pool": v}}, {}), label_value_problem),
    "socket-ifname": (lambda v: ({"name": "gpu-0"}, {"fabric": {"socket_ifname": v}}), socket_ifname_problem),
    "clique-node": (lambda v: ({"name": "gpu-0"}, {"cliques": [{"id": "c0", "nodes": [v]}]}), node_name_problem),
}


@pytest.mark.parametrize("field", sorted(SPEC_FIELDS))
def test_cluster_spec_names(run_cli: RunCli, tmp_path: Path, field: str) -> None:
    make, rule = SPEC_FIELDS[field]

    def check(case: str, value: str) -> None:
        root = tmp_path / case
        root.mkdir()
        node, top = make(value)
        spec = _spec(root, node, **top)
        before = files_under(root)
        out = root / "o"
        result = run_cli("launch", "vllm", "--cluster", str(spec), "--model", "llama-3.1-8b", "--out", str(out))
        if rule(value) or field == "clique-node":  # a clique naming a node the spec does not have is refused too
            assert_clear_error(result, "spec.yaml")
            assert files_under(root) == before
        else:  # ':' in an interface name, '/' in a label: allowed by the rule, and only --out is written
            assert result.exit_code == 0, result.stderr
            assert {p.parent for p in files_under(root) - before} == {out}

    each_case(check)


def test_a_valid_spec_still_launches(run_cli: RunCli, tmp_path: Path) -> None:
    spec = _spec(tmp_path, {"name": "gpu-{i:02d}.rack-1", "count": 2, "rack": "r1", "labels": {"pool": "batch"}})
    result = run_cli("launch", "vllm", "--cluster", str(spec), "--model", "llama-3.1-8b", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["launches"][0]["node"] == "gpu-00.rack-1"


# --- the API --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api() -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from toposched.service.app import create_app
    from toposched.service.config import ServiceConfig
    from toposched.topology.sources import SourceRef

    config = ServiceConfig(state="memory", source=SourceRef(kind="preset", ref="hgx-h100"), auth=False)
    with TestClient(create_app(config)) as client:
        yield client


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_api_refuses_hostile_ids(api: Any, case: str) -> None:
    value = HOSTILE[case]
    placed = api.post("/v1/placements", json={"id": value, "model": "llama-3.1-8b"})
    if value == "":
        assert placed.status_code == 201  # empty: the service makes an id
        generated = placed.json()["id"]
        assert api.delete(f"/v1/placements/{generated}").status_code == 200
    else:
        assert placed.status_code == 422, placed.text
        assert any(f["field"] == "body.id" for f in placed.json()["fields"])
    for method in ("get", "delete"):
        if value:  # (an empty id is the collection's URL)
            answer = getattr(api, method)(f"/v1/placements/{quote(value, safe='')}")
            assert answer.status_code in (404, 422), answer.text
    near = api.post("/v1/placements", json={"id": "near-test", "model": "llama-3.1-8b", "near": value})
    assert near.status_code < 500, near.text
    if near.status_code in (200, 201):
        assert api.delete("/v1/placements/near-test").status_code == 200
    assert api.get("/v1/placements").json()["placements"] == []


def test_api_places_a_valid_id(api: Any) -> None:
    placed = api.post("/v1/placements", json={"id": "good-id.1_a", "model": "llama-3.1-8b"})
    assert placed.status_code == 201, placed.text
    assert [p["id"] for p in api.get("/v1/placements").json()["placements"]] == ["good-id.1_a"]
    assert api.delete("/v1/placements/good-id.1_a").status_code == 200


# --- Kubernetes and Ray output: only the serialiser writes input text -----------------------------


def _yaml_text(docs: list[Any]) -> str:
    """What a plain safe serialiser writes for ``docs`` (no anchors): output with a comment would differ."""

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, explicit_start=True)


def test_k8s_and_ray_yaml_round_trip_without_comments(run_cli: RunCli, tmp_path: Path, multi_plan: Plan) -> None:
    """Hostile text in the options reaches the objects only through the serialiser: YAML = JSON, no comments."""
    multi = tmp_path / "multi.json"
    multi.write_text(json.dumps(multi_plan))
    single = tmp_path / "single.json"
    planned = run_cli(
        "plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--tp", "4", "--replicas", "2", "--json"
    )
    assert planned.exit_code == 0, planned.stderr
    single.write_text(planned.stdout)
    # every printable hostile value at once: quotes, $(...), backticks, '#', ': ', '---', unicode
    value = " ".join(v for v in HOSTILE.values() if v.isprintable() and len(v) < 100) + " # not: a comment\n"[:-1]
    value += " --- &anchor *alias"
    runs: list[tuple[list[str], str | None]] = [
        (["k8s", "--plan", str(multi), "--model-path", value, "--namespace", "llm"], "items"),
        (["k8s", "--plan", str(single), "--model-path", value], "items"),
        (["k8s", "--plan", str(multi), "--kubelet"], "kubelet_configs"),
        (["k8s", "--roles", f"decode={single}", "--model-path", value], "items"),
        (["ray", "--plan", str(multi), "--model-path", value], None),
    ]
    for args, key in runs:
        as_yaml = run_cli("launch", *args, "--format", "yaml")
        as_json = run_cli("launch", *args, "--format", "json")
        assert as_yaml.exit_code == 0 and as_json.exit_code == 0, as_yaml.stderr + as_json.stderr
        docs = list(yaml.safe_load_all(as_yaml.stdout))
        expected = json.loads(as_json.stdout)
        assert docs == (expected[key] if key else [expected]), args
        assert as_yaml.stdout == _yaml_text(docs), args  # nothing but the serialiser's output: no comment lines
        if args[0] == "ray":
            assert value in expected["placement_groups"][0]["argv"]  # carried verbatim, as one argument

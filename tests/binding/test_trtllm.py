"""TensorRT-LLM launches: every option and value in the reference list, mpirun/srun for multi-node
instances, scripts that pass shellcheck, and a KV fraction the memory rule agrees with."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.binding.builders import make_doc, make_placement
from tests.conftest import REFERENCE, RunCli
from toposched.binding.engine_args import FLAG_SOURCES, TRTLLM_YAML_KEYS
from toposched.binding.engines import ENV_VARS, TRTLLM_FLAGS, build_launches
from toposched.binding.k8s_configmap import script_of as script_in
from toposched.binding.launch_script import shell_script, srun_script
from toposched.binding.node_launch import NodeLaunch
from toposched.errors import InputError
from toposched.solver.options import gpu_type_for
from toposched.solver.request import Placement, PlacementRequest
from toposched.solver.scheduler import Scheduler
from toposched.topology.presets import hgx_h100_cluster, load_preset, preset_names
from toposched.workload import MemoryConfig, resolve_model
from toposched.workload.memory import estimate_memory
from toposched.workload.memory_config import TRTLLM_FREE_FRACTION

SERVE_OPTIONS = json.loads((REFERENCE / "data" / "trtllm-serve-options.json").read_text())
OPTIONS: dict[str, str] = {
    name.strip(): kind for names, kind in SERVE_OPTIONS["options"].items() for name in names.split(" / ")
}
LLAMA_8B = Path(__file__).resolve().parents[2] / "src" / "toposched" / "data" / "models" / "Meta-Llama-3.1-8B.json"


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A dense FP8 checkpoint (Llama-3.1-8B with an fp8 ``quantization_config``, as ModelOpt exports)."""
    folder = tmp_path_factory.mktemp("llama-fp8")
    config = json.loads(LLAMA_8B.read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def serve_part(argv: list[str]) -> list[str]:
    """The ``trtllm-serve ...`` words of one rank's command (after numactl, mpirun or srun)."""
    start = argv.index("trtllm-serve")
    end = argv.index(":", start) if ":" in argv[start:] else len(argv)
    return argv[start:end]


def check_value(option: str, value: str | None, launch: NodeLaunch) -> None:
    """``value`` is one the reference list allows for ``option`` (its type or choices)."""
    kind = OPTIONS[option]
    if kind.startswith("flag"):
        assert value is None or value.startswith("--"), (option, value)
        return
    assert value is not None and not value.startswith("--"), (option, value)
    if kind.startswith("int"):
        assert value.isdigit() and int(value) >= 1, (option, value)
    elif kind.startswith("float"):
        assert 0 < float(value) <= 1, (option, value)
    elif kind.startswith("path"):
        assert value in launch.files, (option, value)
    elif "|" in kind:
        choices = {c.split()[0] for c in kind.split(";")[0].split("|")}
        assert value in choices, (option, value, choices)


def check_launch(launch: NodeLaunch, model: str) -> dict[str, Any]:
    """Every option of every rank's command is in the reference list with a valid value; the options
    YAML parses, uses only known keys and holds the flag's KV fraction. Returns the parsed options."""
    serve = serve_part(launch.argv)
    assert serve[1] == model  # the positional MODEL
    words = serve[2:]
    seen: dict[str, str | None] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            assert word in OPTIONS, word
            assert word in TRTLLM_FLAGS, word
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            check_value(word, value, launch)
            assert word not in seen, f"{word} given twice"
            seen[word] = value
    assert seen["--backend"] == "pytorch"
    config = seen["--config"]
    assert config is not None
    options = yaml.safe_load(launch.files[config])
    assert set(options) <= set(TRTLLM_YAML_KEYS)
    assert options["kv_cache_config"]["free_gpu_memory_fraction"] == float(seen["--kv_cache_free_gpu_memory_fraction"])  # type: ignore[arg-type]
    assert set(launch.env) <= ENV_VARS
    return {"flags": seen, "options": options}


def test_every_trtllm_flag_toposched_can_emit_is_in_the_reference() -> None:
    assert set(FLAG_SOURCES["trtllm"]) == TRTLLM_FLAGS
    assert set(OPTIONS) >= TRTLLM_FLAGS, TRTLLM_FLAGS - set(OPTIONS)
    assert "00209af1" in SERVE_OPTIONS["source"]


MODELS = ("llama-3.1-8b", "fp8", "qwen3-30b-a3b")  # dense, dense FP8 checkpoint, MoE
NO_COST_MODEL = frozenset({"dgx1-v100", "dgx2"})
"""Presets whose GPUs (V100) the cost model does not describe: ``plan`` refuses them for every engine."""


@pytest.mark.parametrize("preset", preset_names())
@pytest.mark.parametrize("kind", MODELS)
def test_every_preset_and_model_gives_a_valid_trtllm_launch(preset: str, kind: str, fp8_model: str) -> None:
    model = fp8_model if kind == "fp8" else kind
    cluster = load_preset(preset)
    if preset in NO_COST_MODEL:  # no plan, so nothing to launch (and TensorRT-LLM needs Ampere or later)
        with pytest.raises(InputError, match="does not say which GPU this is"):
            Scheduler(cluster)
        return
    request = PlacementRequest(model=model, max_model_len=8192, ep=2 if kind == "qwen3-30b-a3b" else 1)
    out = Scheduler(cluster).place(request)
    assert out.placements, out.unplaced  # every preset holds these models
    launches = build_launches(out.placements, request, cluster, "trtllm")
    served = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B"}.get(kind, model)
    for launch in launches:
        got = check_launch(launch, served)
        p = next(x for x in out.placements if x.id == launch.placement)
        flags = got["flags"]
        assert (flags["--tp_size"], flags["--pp_size"]) == (str(p.tp), str(p.pp))
        assert flags.get("--ep_size") == (str(p.ep) if p.ep > 1 else None)
        assert flags["--max_seq_len"] == "8192"
        if launch.hosts:  # multi-node: every node holds tp*pp / nodes ranks
            per_node = {sum(1 for r in p.ranks if r.node == n) for n in launch.hosts}
            assert len(per_node) == 1 and flags["--gpus_per_node"] == str(per_node.pop())
        script = shell_script(launch)
        shellcheck(script)


def shellcheck(script: str) -> None:
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    checker = shutil.which("shellcheck")
    if checker:
        done = subprocess.run([checker, "-"], input=script, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def test_a_multi_node_instance_is_one_mpirun_with_a_hostfile_and_an_srun_form() -> None:
    cluster = hgx_h100_cluster(nodes=2)
    request = PlacementRequest(model="llama-3.1-405b", max_model_len=8192, slo_tpot_ms=60)
    (p,) = Scheduler(cluster).place(request).placements
    (launch,) = build_launches([p], request, cluster, "trtllm")
    check_launch(launch, "meta-llama/Llama-3.1-405B")
    argv = launch.argv
    assert argv[0] == "mpirun" and argv[argv.index("-np") + 1] == str(p.tp * p.pp) == "16"
    assert argv[argv.index("--map-by") + 1] == "ppr:8:node"
    assert argv[argv.index("--bind-to") + 1] == "none"  # numactl or nothing binds, not mpirun
    hostfile = launch.files[argv[argv.index("--hostfile") + 1]]
    assert hostfile == "h100-00 slots=8\nh100-01 slots=8\n"
    assert launch.hosts == ["h100-00", "h100-01"] and launch.node == "h100-00"
    forwarded = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert sorted(forwarded) == sorted(launch.env) and "NCCL_IB_HCA" in forwarded
    assert argv[argv.index("trtllm-serve") - 1] == "trtllm-llmapi-launch"
    srun = launch.srun_argv
    assert srun is not None and srun[0] == "srun"
    assert srun[srun.index("--ntasks") + 1] == "16" and srun[srun.index("--ntasks-per-node") + 1] == "8"
    assert srun[srun.index("--nodelist") + 1] == "h100-00,h100-01" and "--mpi=pmix" in srun
    assert serve_part(srun) == serve_part(argv)
    script, srun_text = shell_script(launch), srun_script(launch)
    assert srun_text is not None and "exec srun " in srun_text
    assert f'exec mpirun -np 16 --hostfile "$here"/{p.id}.hostfile ' in script
    shellcheck(script)
    shellcheck(srun_text)


def test_nodes_with_different_gpus_get_one_mpmd_context_each() -> None:
    cluster = hgx_h100_cluster(nodes=2)
    p = make_placement([("h100-00", range(4)), ("h100-01", range(4, 8))], tp=4, pp=2)
    doc = make_doc(cluster, p)
    (launch,) = build_launches(doc.placements, doc.request, cluster, "trtllm")
    argv = launch.argv
    assert argv[:2] == ["mpirun", "--hostfile"] and argv.count(":") == 1 and launch.srun_argv is None
    first, second = " ".join(argv).split(" : ")
    assert "--host h100-00:4 " in first and "-x CUDA_VISIBLE_DEVICES=0,1,2,3 " in first
    assert "--host h100-01:4 " in second and "-x CUDA_VISIBLE_DEVICES=4,5,6,7 " in second
    assert "numactl --cpunodebind=0" in first and "numactl --cpunodebind=1" in second
    assert launch.env == {}  # every variable travels with its context
    script = shell_script(launch)
    assert "-x 'NCCL_IB_HCA==mlx5_0,mlx5_1,mlx5_2,mlx5_3'" in script
    shellcheck(script)


def test_unequal_ranks_per_node_are_refused() -> None:
    cluster = hgx_h100_cluster(nodes=2)
    p = make_placement([("h100-00", range(6)), ("h100-01", range(2))], tp=4, pp=2)
    doc = make_doc(cluster, p)
    with pytest.raises(InputError, match="h100-00 has 6, h100-01 has 2 GPUs; multi-node engines need the same"):
        build_launches(doc.placements, doc.request, cluster, "trtllm")


def test_the_launch_fraction_gives_the_plan_kv_under_the_trtllm_rule() -> None:
    """``fit --engine trtllm``'s rule with the launch's fraction makes the pool the plan reserved."""
    cluster = load_preset("hgx-h100")
    for model, kw in (("llama-3.1-70b", {"slo_tpot_ms": 40}), ("llama-3.1-8b", {}), ("mixtral-8x7b", {"ep": 2})):
        request = PlacementRequest(model=model, max_model_len=8192, concurrent_seqs=8, **kw)
        (p, *_) = Scheduler(cluster).place(request).placements
        assert p.pp == 1
        (launch,) = build_launches([p], request, cluster, "trtllm")
        fraction = float(launch.argv[launch.argv.index("--kv_cache_free_gpu_memory_fraction") + 1])
        gpu = gpu_type_for(cluster.nodes[0].gpus[0].model)
        cfg = MemoryConfig(engine="trtllm", max_num_seqs=8, kv_cache_free_gpu_memory_fraction=fraction)
        est = estimate_memory(
            resolve_model(model), gpu_memory_bytes=gpu.usable_memory_bytes, tp=p.tp, ep=p.ep,
            max_model_len=8192, num_seqs=8, config=cfg,
        )  # fmt: skip
        free = gpu.usable_memory_bytes - est.weights_bytes_per_gpu - est.activation_bytes - est.non_torch_bytes
        planned = p.hbm_per_gpu.kv + (p.experts.extra_bytes_per_gpu if p.experts else 0)
        assert est.kv_budget_bytes <= planned  # never more than the plan reserved ...
        assert planned - est.kv_budget_bytes <= free / 1000 + 1  # ... and less only by the 3-decimal rounding
        assert 0 < fraction < TRTLLM_FREE_FRACTION + 0.1


def test_a_plan_without_memory_figures_gets_the_default_fraction() -> None:
    cluster = load_preset("hgx-h100")
    doc = make_doc(
        cluster, make_placement([("hgx-h100", range(8))], tp=8, model="llama-3.1-70b"), model="llama-3.1-70b"
    )
    (launch,) = build_launches(doc.placements, doc.request, cluster, "trtllm")
    assert launch.argv[launch.argv.index("--kv_cache_free_gpu_memory_fraction") + 1] == f"{TRTLLM_FREE_FRACTION:g}"
    assert MemoryConfig(engine="trtllm").kv_cache_free_gpu_memory_fraction == TRTLLM_FREE_FRACTION


def _one(model: str, **kw: Any) -> tuple[list[Placement], PlacementRequest, Any]:
    cluster = load_preset("hgx-h200")
    request = PlacementRequest(model=model, max_model_len=8192, **kw)
    return Scheduler(cluster).place(request).placements, request, cluster


def test_what_has_no_flag_goes_into_the_options_yaml() -> None:
    placements, request, cluster = _one("llama-3.1-8b", kv_dtype="fp8", weight_dtype="fp16")
    (launch,) = build_launches(placements, request, cluster, "trtllm")
    options = check_launch(launch, "meta-llama/Llama-3.1-8B")["options"]
    assert options["kv_cache_config"]["dtype"] == "fp8"
    assert options["dtype"] == "float16"
    # the operating point the plan chose is the engine's batch limit, and its CUDA graphs cover it
    assert placements[0].max_num_seqs is not None and placements[0].max_num_seqs > 8
    assert options["cuda_graph_config"] == {"max_batch_size": placements[0].max_num_seqs, "enable_padding": True}
    assert launch.argv[launch.argv.index("--max_batch_size") + 1] == str(placements[0].max_num_seqs)


@pytest.mark.parametrize(
    ("model", "kw", "message"),
    [
        ("llama-3.1-8b", {"weight_dtype": "fp8"}, "does not quantize while loading"),
        ("llama-3.1-8b", {"kv_dtype": "int8"}, "needs a int8 KV cache"),
        (
            "mixtral-8x7b",
            {"allowed_tp": (2,), "ep": 2, "expert_replicas": 2, "expert_hit_rates": (0.4, 0.2, 0.1, 0.1) + (0.05,) * 4},
            "TensorRT-LLM has no redundant experts for 'mixtral' models",
        ),
    ],
)
def test_plans_tensorrt_llm_cannot_run_as_planned_are_refused(model: str, kw: dict[str, Any], message: str) -> None:
    placements, request, cluster = _one(model, **kw)
    assert placements
    assert "expert_replicas" not in kw or placements[0].experts.redundant_experts  # type: ignore[union-attr]
    with pytest.raises(InputError, match=message):
        build_launches(placements, request, cluster, "trtllm")


def test_cli_writes_the_script_beside_its_options_yaml(run_cli: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cli("launch", "trtllm", "-m", "llama-3.1-70b", "--preset", "hgx-h100", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["plan-hgx-h100.sh", "plan.trtllm.yaml"]
    script = (out / "plan-hgx-h100.sh").read_text()
    assert '--config "$here"/plan.trtllm.yaml' in script
    assert yaml.safe_load((out / "plan.trtllm.yaml").read_text())["kv_cache_config"]["free_gpu_memory_fraction"] > 0
    # run from elsewhere, the script finds the YAML beside itself
    (out / "probe.sh").write_text(script.replace("exec ", "printf '%s\\n' "))
    done = subprocess.run(["bash", str(out / "probe.sh")], capture_output=True, text=True, cwd="/", check=True)
    words = done.stdout.splitlines()
    assert words[words.index("--config") + 1] == str((out / "plan.trtllm.yaml").resolve())
    printed = run_cli("launch", "trtllm", "-m", "llama-3.1-70b", "--preset", "hgx-h100")
    assert printed.exit_code == 2 and "plan.trtllm.yaml, written next to its script" in printed.stderr
    addr = run_cli("launch", "trtllm", "-m", "llama-3.1-8b", "--preset", "hgx-h100", "--master-addr", "h", "--json")
    assert addr.exit_code == 2 and "ranks meet through MPI" in addr.stderr


def test_cli_multi_node_writes_mpirun_srun_and_hostfile(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli(
        "launch", "trtllm", "-m", "llama-3.1-405b", "--preset", "cluster-32x-hgx-h100", "--out", str(tmp_path)
    )
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["plan-h100-00.sh", "plan-h100-00.srun.sh", "plan.hostfile", "plan.trtllm.yaml"]
    assert (tmp_path / "plan-h100-00.srun.sh").stat().st_mode & 0o111
    assert not (tmp_path / "plan.hostfile").stat().st_mode & 0o111
    for name in ("plan-h100-00.sh", "plan-h100-00.srun.sh"):
        shellcheck((tmp_path / name).read_text())


def test_kubernetes_and_ray_forms(run_cli: RunCli) -> None:
    args = ("-m", "llama-3.1-70b", "--preset", "hgx-h100", "--image", "example.org/trtllm:1", "--format", "json")
    k8s = run_cli("launch", "k8s", "--engine", "trtllm", *args)
    assert k8s.exit_code == 0, k8s.stderr
    items = json.loads(k8s.stdout)["items"]
    (deployment,) = [o for o in items if o["kind"] == "Deployment"]
    entry = script_in(items, deployment["spec"]["template"])
    assert "cat > /tmp/toposched/plan.trtllm.yaml <<'TOPOSCHED_EOF'\nkv_cache_config:" in entry
    assert "--config /tmp/toposched/plan.trtllm.yaml" in entry
    no_image = run_cli("launch", "k8s", "--engine", "trtllm", "-m", "llama-3.1-70b", "--preset", "hgx-h100")
    assert no_image.exit_code == 2 and "--image" in no_image.stderr
    multi = run_cli("launch", "k8s", "--engine", "trtllm", "-m", "llama-3.1-405b", "--preset", "cluster-32x-hgx-h100",
                    "--image", "example.org/trtllm:1", "--format", "json")  # fmt: skip
    assert multi.exit_code == 0, multi.stderr  # a LeaderWorkerSet whose leader runs mpirun (test_trtllm_k8s.py)
    assert [o["kind"] for o in json.loads(multi.stdout)["items"]] == ["ConfigMap", "LeaderWorkerSet"]
    ray = run_cli("launch", "ray", "--engine", "trtllm", "-m", "llama-3.1-8b", "--preset", "hgx-h100")
    assert ray.exit_code == 2 and len(ray.stderr.splitlines()) == 2
    assert "no Ray executor was found" in ray.stderr and "00209af1" in ray.stderr and "tensorrt-llm 1.2.1" in ray.stderr


def test_a_pipeline_plan_gets_a_valid_fraction() -> None:
    """With pp > 1 the plan's figures mix stages (heaviest weights, fewest KV tokens): still a valid share."""
    cluster = hgx_h100_cluster(nodes=2)
    request = PlacementRequest(model="llama-3.1-405b", max_model_len=8192, slo_tpot_ms=60)
    (p,) = Scheduler(cluster).place(request).placements
    assert p.pp > 1 and p.hbm_per_gpu.kv > 0
    (launch,) = build_launches([p], request, cluster, "trtllm")
    assert 0 < float(launch.argv[launch.argv.index("--kv_cache_free_gpu_memory_fraction") + 1]) <= 1


def test_a_hostile_model_path_reaches_every_rank_verbatim(tmp_path: Path) -> None:
    """Quoting holds in the mpirun form too: the path is one word per rank and runs nothing."""
    cluster = hgx_h100_cluster(nodes=2)
    p = make_placement([("h100-00", range(4)), ("h100-01", range(4, 8))], tp=4, pp=2)
    doc = make_doc(cluster, p)
    marker = tmp_path / "ran"
    hostile = f"/m/x $(touch {marker}) `touch {marker}` '\"; touch {marker}"
    (launch,) = build_launches(doc.placements, doc.request, cluster, "trtllm", model_path=hostile)
    script = tmp_path / "s.sh"
    script.write_text(shell_script(launch).replace("exec ", "printf '%s\\n' "))
    words = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert words.count(hostile) == 2 and not marker.exists()  # one trtllm-serve per MPMD context
    assert all(hostile not in text for text in launch.files.values())  # the YAML holds no input text

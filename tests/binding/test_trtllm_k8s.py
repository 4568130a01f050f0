"""TensorRT-LLM on Kubernetes across nodes: one LeaderWorkerSet whose leader starts every rank with mpirun
over ssh. The objects are checked against the LWS CRD schema and kubernetes-validate, the scripts with
shellcheck, and both pods' scripts are run under /bin/sh with fake nvidia-smi, ssh, sshd and mpirun
(their fixed paths, /tmp/toposched and /etc/toposched/mpi-ssh, moved under the test's folder)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from checks.engines.crd_schemas import LEADER_WORKER_SET

from tests.binding.builders import make_doc, make_placement
from tests.binding.k8s_views import render_objects, script_of
from tests.binding.test_k8s import expressions, validate, validate_template
from tests.binding.test_k8s_dra import captured, with_fabric
from tests.binding.test_trtllm import OPTIONS, serve_part
from tests.conftest import RunCli
from toposched.binding.k8s import lint_nodes
from toposched.binding.k8s_entrypoint import FILES_DIR, MPI_SSH_DIR
from toposched.binding.k8s_options import K8sOptions
from toposched.binding.plan_doc import PlanDoc
from toposched.errors import InputError
from toposched.topology.presets import hgx_h100_cluster

IMAGE = "registry.invalid/tensorrt-llm:pinned"
OPTS = K8sOptions(engine="trtllm", image=IMAGE)


def three_nodes(**fabric: Any) -> PlanDoc:
    """TP 8 x PP 3 over three HGX H100 nodes, with real (captured) bus ids so the pods pin their GPUs."""
    p = make_placement([(f"h100-0{i}", range(8)) for i in range(3)], tp=8, pp=3)
    doc = captured(make_doc(hgx_h100_cluster(nodes=3), p), uuids=False)
    return with_fabric(doc, **fabric) if fabric else doc


def lws_of(doc: PlanDoc, opts: K8sOptions = OPTS) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    out = render_objects(doc, opts)
    (lws,) = [o for o in out.objects if o["kind"] == "LeaderWorkerSet"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    return lws, lwt["leaderTemplate"], lwt["workerTemplate"]


def script(template: dict[str, Any]) -> str:
    return script_of(template)


def shellcheck(text: str) -> None:
    subprocess.run(["sh", "-n"], input=text, text=True, check=True)
    checker = shutil.which("shellcheck")
    if checker:
        done = subprocess.run([checker, "--shell=sh", "--norc", "-"], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


# --- the objects -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pinned", [False, True], ids=["device-plugin", "dra"])
def test_a_multi_node_plan_is_one_valid_leader_worker_set(plans: dict[str, PlanDoc], pinned: bool) -> None:
    doc = captured(plans["multi"]) if pinned else plans["multi"]
    out = render_objects(doc, OPTS)
    assert out.gpu_request == ("dra" if pinned else "device-plugin")
    for obj in out.objects:
        if obj["kind"] == "LeaderWorkerSet":
            jsonschema.Draft202012Validator(LEADER_WORKER_SET).validate(obj)
        else:
            validate(obj)  # the ResourceClaimTemplates
    lws, leader, worker = lws_of(doc)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for template, key, port in ((leader, "ssh-privatekey", ("http", 8000)), (worker, "ssh-publickey", ("ssh", 2222))):
        validate_template(template)
        spec, container = template["spec"], template["spec"]["containers"][0]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "mpi-ssh"]
        assert volume["secret"] == {
            "secretName": "toposched-mpi-ssh", "items": [{"key": key, "path": key}], "defaultMode": 0o400,
        }  # fmt: skip
        assert {"name": "mpi-ssh", "mountPath": MPI_SSH_DIR, "readOnly": True} in container["volumeMounts"]
        assert (container["ports"][0]["name"], container["ports"][0]["containerPort"]) == port
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        shellcheck(script(template))
    assert expressions(leader)["kubernetes.io/hostname"]["values"] == ["h100-00"]
    assert expressions(worker)["kubernetes.io/hostname"]["values"] == ["h100-01"]
    (warning,) = [w for w in out.warnings if "mpirun over ssh" in w]
    assert "create secret generic toposched-mpi-ssh --from-file=ssh-privatekey=key" in warning


def test_the_leader_runs_the_options_of_launch_trtllm_under_mpirun(plans: dict[str, PlanDoc]) -> None:
    _, leader, worker = lws_of(plans["multi"])
    text = script(leader)
    exec_line = text.splitlines()[-1]
    assert exec_line.startswith('exec "$mpirun" --allow-run-as-root --prefix "${mpirun%/bin/*}" -np 16 ')
    words = exec_line.split()
    serve = serve_part(words)
    assert words[words.index("trtllm-serve") - 2 : words.index("trtllm-serve")] == [
        f"{FILES_DIR}/rank", "trtllm-llmapi-launch",
    ]  # fmt: skip
    assert all(w in OPTIONS for w in serve if w.startswith("--"))
    assert serve[serve.index("--gpus_per_node") + 1] == "8" and serve[serve.index("--tp_size") + 1] == "8"
    assert serve[serve.index("--config") + 1] == f"{FILES_DIR}/plan.trtllm.yaml"
    assert f"cat > {FILES_DIR}/plan.trtllm.yaml <<'TOPOSCHED_EOF'\nkv_cache_config:" in text
    assert "trtllm-serve" not in script(worker) and "mpirun" not in script(worker).replace("mpirun on the", "")
    assert "plan.trtllm.yaml" not in script(worker)  # only rank 0's process reads the options


def test_own_secret_and_a_port_per_placement() -> None:
    cluster = hgx_h100_cluster(nodes=2)
    a = make_placement([("h100-00", range(4)), ("h100-01", range(4))], tp=4, pp=2, id="a")
    b = make_placement([("h100-00", range(4, 8)), ("h100-01", range(4, 8))], tp=4, pp=2, id="b")
    doc = with_fabric(captured(make_doc(cluster, a, b), uuids=False), host_network=True)
    opts = K8sOptions(engine="trtllm", image=IMAGE, mpi_ssh_secret="llm.mpi-keys")
    objects = [o for o in render_objects(doc, opts).objects if o["kind"] == "LeaderWorkerSet"]
    ports = []
    for lws in objects:
        worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        assert worker["spec"]["hostNetwork"] is True
        (secret,) = [v["secret"] for v in worker["spec"]["volumes"] if "secret" in v]
        assert secret["secretName"] == "llm.mpi-keys"
        ports.append(worker["spec"]["containers"][0]["ports"][0]["containerPort"])
        assert f"Port {ports[-1]}\n" in script(worker)
        assert f"  Port {ports[-1]}\n" in script(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    assert ports == [2222, 2223]  # both workers share h100-01's network
    with pytest.raises(InputError, match="--ssh-secret 'Keys_A' is not a Secret name"):
        K8sOptions(engine="trtllm", mpi_ssh_secret="Keys_A")


def test_lint_checks_every_node_of_the_instance(plans: dict[str, PlanDoc]) -> None:
    findings = lint_nodes(plans["multi"], {"items": []}, OPTS)
    assert sorted(f.node for f in findings) == ["h100-00", "h100-01"]


# --- the scripts, run ------------------------------------------------------------------------------

FAKES = {
    "nvidia-smi": 'cat "$FAKE_GPUS"\n',
    "numactl": 'printf \'%s\\n\' "$@" > "$REC/numactl"\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n',
    "id": "echo 0\n",
    "sleep": "exit 0\n",
    "ssh-keygen": 'while [ "$1" != -f ]; do shift; done\n: > "$2"; : > "$2.pub"\n',
    "sshd": 'printf \'%s\\n\' "$@" > "$REC/sshd"\n',
    # ssh -F CONFIG HOST cat FILE: the node the worker pod HOST runs on, from "HOST NODE" lines
    "ssh": 'awk -v h="$3" \'$1 == h { print $2; f = 1 } END { exit !f }\' "$FAKE_WORKERS" || exit 255\n',
    "mpirun": 'printf \'%s\\n\' "$@" > "$REC/mpirun"\n',
}


def run_pod(
    tmp_path: Path,
    template: dict[str, Any],
    node: str,
    visible: list[str],
    workers: dict[str, str] | None = None,
    group_size: str = "3",
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "gpus.csv").write_text("".join(g + "\n" for g in visible))
    (tmp_path / "workers.map").write_text("".join(f"{h} {n}\n" for h, n in (workers or {}).items()))
    (tmp_path / "rec").mkdir(exist_ok=True)
    container = template["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(
        NODE_NAME=node, LWS_LEADER_ADDRESS="grp-0.grp.default", LWS_GROUP_SIZE=group_size, LWS_WORKER_INDEX="1",
        PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_GPUS=str(tmp_path / "gpus.csv"), REC=str(tmp_path / "rec"),
        FAKE_WORKERS=str(tmp_path / "workers.map"), HOME=str(tmp_path),
    )  # fmt: skip
    text = script_of(template)
    for fixed, moved in ((FILES_DIR, "ts"), (MPI_SSH_DIR, "keys"), ("/run/sshd", "run-sshd")):
        text = text.replace(fixed, str(tmp_path / moved))
    return subprocess.run(
        ["/bin/sh", "-c", text], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False
    )


def visible(node: int, gpus: range = range(8)) -> list[str]:
    """What a pod on ``h100-0N`` sees: ``gpus`` (bus ids as the preset has them), listed out of order."""
    return [f"00000000:{g + 1}8:00.0, GPU-n{node}-{g}" for g in reversed(gpus)]


def test_a_worker_publishes_its_node_and_environment_and_serves_ssh(tmp_path: Path) -> None:
    doc = three_nodes()
    _, _, worker = lws_of(doc)
    done = run_pod(tmp_path, worker, "h100-02", visible(2))
    assert done.returncode == 0, done.stderr
    ts = tmp_path / "ts"
    assert (ts / "node").read_text() == "h100-02\n"
    sshd = (tmp_path / "rec/sshd").read_text().splitlines()
    assert sshd == ["-D", "-e", "-f", f"{ts}/ssh/sshd_config"]
    config = (ts / "ssh/sshd_config").read_text()
    assert "Port 2222\n" in config and f"AuthorizedKeysFile {tmp_path}/keys/ssh-publickey\n" in config
    assert "PasswordAuthentication no\n" in config
    # A rank that mpirun starts over ssh has none of the pod's variables: the wrapper brings them back.
    rank = subprocess.run(
        ["env", "-i", f"PATH={tmp_path / 'bin'}:/usr/bin:/bin", f"{ts}/rank", "sh", "-c",
         'printf "%s|%s|%s" "$CUDA_VISIBLE_DEVICES" "$NCCL_IB_HCA" "$NODE_NAME"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    gpus = ",".join(f"GPU-n2-{g}" for g in range(8))
    assert rank.stdout == f"{gpus}|=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7|h100-02"


def test_the_leader_orders_the_hostfile_by_the_plan_not_by_worker_index(tmp_path: Path) -> None:
    """Worker pod 1 landed on h100-02 and pod 2 on h100-01: ranks 8-15 must still go to h100-01."""
    _, leader, _ = lws_of(three_nodes())
    workers = {"grp-0-1.grp.default": "h100-02", "grp-0-2.grp.default": "h100-01"}
    done = run_pod(tmp_path, leader, "h100-00", visible(0), workers)
    assert done.returncode == 0, done.stderr
    ts = tmp_path / "ts"
    assert (ts / "plan-0.hostfile").read_text() == (
        "localhost slots=8\ngrp-0-2.grp.default slots=8\ngrp-0-1.grp.default slots=8\n"
    )
    argv = (tmp_path / "rec/mpirun").read_text().splitlines()
    assert argv[argv.index("--prefix") + 1] == str(tmp_path)  # where bin/mpirun is: Open MPI's remote PATH
    assert argv[argv.index("-np") + 1] == "24" and argv[argv.index("--map-by") + 1] == "ppr:8:node"
    assert argv[argv.index("plm_rsh_args") + 1] == f"-F {ts}/ssh/ssh_config"
    assert argv[argv.index("--config") + 1] == f"{ts}/plan-0.trtllm.yaml" and (ts / "plan-0.trtllm.yaml").exists()
    ssh_config = (ts / "ssh/ssh_config").read_text()
    assert "  Port 2222\n" in ssh_config and f"  IdentityFile {tmp_path}/keys/ssh-privatekey\n" in ssh_config
    assert "grep" not in (ts / "rank").read_text() and (ts / "rank").stat().st_mode & 0o111


@pytest.mark.parametrize(
    ("workers", "size", "message"),
    [
        ({"grp-0-1.grp.default": "h100-02"}, "3", "worker grp-0-2.grp.default did not answer ssh on port 2222"),
        ({"grp-0-1.grp.default": "h100-02", "grp-0-2.grp.default": "h100-02"}, "3", "no worker pod runs on planned "
         "node h100-01; workers: h100-02 grp-0-1.grp.default h100-02 grp-0-2.grp.default"),
        ({}, "2", "this LeaderWorkerSet group has 2 pods; the plan has 3 nodes"),
    ],
)  # fmt: skip
def test_the_leader_stops_with_a_reason(tmp_path: Path, workers: dict[str, str], size: str, message: str) -> None:
    _, leader, _ = lws_of(three_nodes())
    done = run_pod(tmp_path, leader, "h100-00", visible(0), workers, group_size=size)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "rec/mpirun").exists()


def test_nodes_that_differ_get_their_own_numactl_and_nics(tmp_path: Path) -> None:
    """Half-node pods (GPUs 0-3 on NUMA node 0, 4-7 on node 1): each node's wrapper binds its own NUMA node."""
    p = make_placement([("h100-00", range(4)), ("h100-01", range(4, 8))], tp=4, pp=2)
    doc = captured(make_doc(hgx_h100_cluster(nodes=2), p), uuids=False)
    _, leader, worker = lws_of(doc)
    assert "numactl --cpunodebind=1 --membind=1" in script(worker)
    assert "export NCCL_IB_HCA" not in script(worker)  # one worker node: its NICs are in the container's env
    done = run_pod(tmp_path, worker, "h100-01", visible(1, range(4, 8)))
    assert done.returncode == 0, done.stderr
    subprocess.run([f"{tmp_path}/ts/rank", "true"], check=True, env={"PATH": f"{tmp_path}/bin:/usr/bin:/bin"})
    assert (tmp_path / "rec/numactl").read_text().splitlines()[:2] == ["--cpunodebind=1", "--membind=1"]
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["NCCL_IB_HCA"] == "=mlx5_4,mlx5_5,mlx5_6,mlx5_7"
    assert {e["name"]: e.get("value") for e in leader["spec"]["containers"][0]["env"]}["NCCL_IB_HCA"] == (
        "=mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    )


def test_workers_on_nodes_with_other_nics_export_their_own(tmp_path: Path) -> None:
    """Three nodes, the workers' halves differ: the variable they do not share is exported per node."""
    blocks = [("h100-00", range(4)), ("h100-01", range(4)), ("h100-02", range(4, 8))]
    doc = captured(make_doc(hgx_h100_cluster(nodes=3), make_placement(blocks, tp=4, pp=3)), uuids=False)
    _, _, worker = lws_of(doc)
    assert "NCCL_IB_HCA" not in {e["name"] for e in worker["spec"]["containers"][0]["env"]}
    text = script(worker)
    assert "    export NCCL_IB_HCA='=mlx5_0,mlx5_1,mlx5_2,mlx5_3'\n" in text
    assert "    export NCCL_IB_HCA='=mlx5_4,mlx5_5,mlx5_6,mlx5_7'\n" in text
    shellcheck(text)
    done = run_pod(tmp_path, worker, "h100-02", visible(2, range(4, 8)))
    assert done.returncode == 0, done.stderr
    assert "export NCCL_IB_HCA='=mlx5_4,mlx5_5,mlx5_6,mlx5_7'" in (tmp_path / "ts/pod.env").read_text()


def test_a_hostile_model_path_runs_nothing_in_the_leader(tmp_path: Path) -> None:
    evil = "/models/x $(touch PWNED1) `touch PWNED2` $(HOME); touch PWNED3 'q\""
    _, leader, _ = lws_of(three_nodes(), K8sOptions(engine="trtllm", image=IMAGE, model_path=evil))
    workers = {"grp-0-1.grp.default": "h100-01", "grp-0-2.grp.default": "h100-02"}
    done = run_pod(tmp_path, leader, "h100-00", visible(0), workers)
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.glob("PWNED*"))
    argv = (tmp_path / "rec/mpirun").read_text().split("\n")
    assert argv[argv.index("trtllm-serve") + 1] == evil


def test_cli_renders_the_leader_worker_set_with_its_secret(run_cli: RunCli) -> None:
    args = ["-m", "llama-3.1-405b", "--preset", "cluster-32x-hgx-h100", "--image", IMAGE, "--format", "json"]
    done = run_cli("launch", "k8s", "--engine", "trtllm", *args, "--ssh-secret", "llm-keys")
    assert done.exit_code == 0, done.stderr
    assert "create secret generic llm-keys" in done.stderr
    bad = run_cli("launch", "k8s", "--engine", "trtllm", *args, "--ssh-secret", "-x")
    assert bad.exit_code == 2 and "is not a Secret name" in bad.stderr and "Traceback" not in bad.stderr


# --- for real: sshd and Open MPI's mpirun, in a network namespace of the test's own -----------------

E2E_TOOLS = all(shutil.which(t) for t in ("unshare", "ip", "mpirun", "ssh", "ssh-keygen")) and (
    os.path.exists("/usr/sbin/sshd") and hasattr(os, "geteuid") and os.geteuid() == 0
)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FAKE_RANK = (  # what each rank runs instead of trtllm-llmapi-launch: where it ran, on which GPUs, with what
    '#!/bin/sh\nprintf "%s|%s|%s\\n" "$NODE_NAME" "$CUDA_VISIBLE_DEVICES" "$*" > "$OUT/rank.$OMPI_COMM_WORLD_RANK"\n'
)


@pytest.mark.skipif(not E2E_TOOLS, reason="needs root, unshare, ip, sshd, ssh and Open MPI's mpirun")
def test_mpirun_over_ssh_starts_each_rank_in_its_pod_with_its_gpus(tmp_path: Path) -> None:
    """The leader and worker scripts as rendered, run side by side in a private network namespace whose
    /etc/hosts names the worker pod, each pod with its own ``/tmp/toposched`` (a tmpfs in a mount namespace
    of its own, at a path under the test's folder): the real sshd, ssh and mpirun start ranks 2-3 in the
    worker's pod, through its rank wrapper, on its GPUs; ``trtllm-llmapi-launch`` is a fake that records."""
    p = make_placement([("h100-00", range(2)), ("h100-01", range(2))], tp=2, pp=2)
    doc = captured(make_doc(hgx_h100_cluster(nodes=2), p), uuids=False)
    _, leader, worker = lws_of(doc)
    bin_dir, out, files, keys = (tmp_path / d for d in ("bin", "out", "ts", "keys"))
    for folder in (bin_dir, out, files, keys):
        folder.mkdir()
    for name, body in (("nvidia-smi", "#!/bin/sh\n" + FAKES["nvidia-smi"]), ("trtllm-llmapi-launch", FAKE_RANK)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "ssh-privatekey")], check=True)
    (keys / "ssh-privatekey.pub").rename(keys / "ssh-publickey")
    runs = []
    for template, node in ((worker, "h100-01"), (leader, "h100-00")):
        (tmp_path / f"{node}.csv").write_text("".join(g + "\n" for g in visible(int(node[-1]), range(2))))
        env = {e["name"]: e["value"] for e in template["spec"]["containers"][0]["env"] if "value" in e}
        env.update(
            NODE_NAME=node, LWS_LEADER_ADDRESS="grp-0.grp.default", LWS_GROUP_SIZE="2", OUT=str(out),
            FAKE_GPUS=str(tmp_path / f"{node}.csv"), PATH=f"{bin_dir}:{SYSTEM_PATH}", HOME=str(tmp_path),
        )  # fmt: skip
        text = script_of(template)
        text = text.replace(FILES_DIR, str(files)).replace(MPI_SSH_DIR, str(keys))  # sshd insists on /run/sshd
        text = text.replace("numactl --cpunodebind=0 --membind=0 ", "")  # numactl may be missing here
        text = text.replace('"$waited" -ge 600', '"$waited" -ge 30')  # a broken worker fails the test sooner
        text = text.replace("    sleep 5\n", "    sleep 0.2\n")  # and the first retry comes sooner
        (tmp_path / f"{node}.sh").write_text(text)
        pod = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        inner = f"mount -t tmpfs pod {files} && exec env -i {pod} /bin/sh {tmp_path}/{node}.sh"
        runs.append(f"unshare -m /bin/sh -c {shlex.quote(inner)} > {tmp_path}/{node}.log 2>&1")
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n127.0.0.2 grp-0-1.grp.default\n")
    orchestrate = "\n".join([
        "set -u", "ip link set lo up", f"mount --bind {tmp_path}/hosts /etc/hosts",
        f"{runs[0]} &", "worker=$!", runs[1], "rc=$?", 'kill "$worker"', 'exit "$rc"',
    ])  # fmt: skip
    run = subprocess.Popen(["unshare", "-n", "-m", "/bin/sh", "-c", orchestrate], start_new_session=True)
    try:
        returncode = run.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)  # sshd, mpirun and the scripts are all in this session
        run.wait()
        returncode = -1
    logs = "".join(f"--- {pod}:\n" + (tmp_path / f"{pod}.log").read_text() for pod in ("h100-00", "h100-01"))
    assert returncode == 0, logs
    ranks = {int(f.name.split(".")[1]): f.read_text().strip().split("|") for f in out.glob("rank.*")}
    assert sorted(ranks) == [0, 1, 2, 3], logs
    for rank, (node, gpus, argv) in ranks.items():
        n = rank // 2
        assert (node, gpus) == (f"h100-0{n}", f"GPU-n{n}-0,GPU-n{n}-1"), (rank, logs)
        assert argv.startswith("trtllm-serve meta-llama/Llama-3.1-405B --backend pytorch --tp_size 2 --pp_size 2")
        assert f"--config {files}/plan-0.trtllm.yaml" in argv and "--gpus_per_node 2" in argv

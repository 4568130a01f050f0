"""CLI arguments: every command line with a user value (GPU lists, names, paths, options).

Each case fills the ``{}`` of one command line with a drawn value and runs it in-process from the
case folder, so relative paths stay inside it; ``HOSTILE_PATHS`` names special files, folders and a
17 MiB file there. The long run also tries every command line with every hostile name and path.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

from tests.conftest import FIXTURES
from tests.fuzz.harness import Case, Target
from tests.fuzz.mutate import HOSTILE_NAMES
from tests.fuzz.targets import CLI_OK, HOSTILE_PATHS, add_hostile_files, chdir, cli, plan_bytes, register

CLI_TEMPLATES: tuple[tuple[str, ...], ...] = (
    ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--busy", "{}"),
    ("plan", "--preset", "hgx-h100", "--model", "mixtral-8x7b", "--ep", "2", "--expert-hit-rates", "{}"),
    ("plan", "--preset", "{}", "--model", "llama-3.1-8b"),
    ("plan", "--smi", "{}", "--model", "llama-3.1-8b"),
    ("plan", "--cluster", "{}", "--model", "llama-3.1-8b"),
    ("plan", "--preset", "hgx-h100", "--model", "{}"),
    ("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--gpu", "{}", "--weight-dtype", "{}"),
    ("fit", "--model", "{}", "--gpu", "H100-SXM"),
    ("fit", "--model", "llama-3.1-8b", "--gpu", "{}", "--kv-dtype", "{}"),
    (
        "estimate",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "H100-SXM",
        "--tp",
        "1",
        "--batch",
        "1",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--link",
        "{}",
    ),
    ("allocate", "--preset", "hgx-h100", "--size", "2", "--available", "{}", "--json"),
    ("allocate", "--preset", "hgx-h100", "--size", "2", "--must-include", "{}"),
    ("allocate", "--preset", "cluster-32x-hgx-h100", "--size", "2", "--node", "{}"),
    ("verify", "topo", "--smi", str(FIXTURES / "topo" / "07_dgx1-v100-1nic-driver440.txt"), "--gpus", "{}"),
    ("verify", "nccl", "{}"),
    ("topo", "show", "--smi", "{}"),
    ("topo", "show", "--cluster", "{}"),
    ("simulate", "--scenario", "{}", "--requests", "5", "--policies", "slo", "--json"),
    ("simulate", "--scenario", "small", "--requests", "5", "--policies", "{}", "--json"),
    ("launch", "vllm", "--plan", "{}"),
    ("calibrate", "{}", "--gpu", "H100-SXM", "--samples-only"),
    ("calibrate", "{}", "--format", "{}", "--gpu", "{}", "--tp", "{}"),
    ("estimate", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--tp", "1", "--profile", "{}"),
    ("defrag", "--state", "{}", "--need-gpus", "8"),
    ("launch", "k8s", "--roles", "{}"),
    ("launch", "k8s", "--plan", "plan.json", "--namespace", "{}", "--name-prefix", "{}", "--shm-size", "{}"),
    ("launch", "k8s", "--plan", "plan.json", "--cpu", "{}", "--memory", "{}", "--image", "{}"),
    ("launch", "k8s", "--plan", "plan.json", "--kubelet", "--topology-policy", "{}"),
    ("launch", "ray", "--plan", "plan.json", "--model-path", "{}", "--format", "yaml"),
    ("sidecar", "--placement", "{}", "--plan", "plan.json", "--fake", "steady", "--iterations", "1"),
    ("sidecar", "--placement", "{}"),
    (
        "sidecar",
        "--placement",
        "plan-0",
        "--plan",
        "plan.json",
        "--fake",
        "steady",
        "--iterations",
        "1",
        "--token-file",
        "{}",
    ),
    ("ledger", "show", "--state", "{}"),
    ("ledger", "release", "{}", "--state", "state.sqlite3"),
)
"""CLI commands with one or more user-supplied values (``{}``), all filled with the drawn value."""


def cli_values() -> st.SearchStrategy[str]:
    plain = st.sampled_from(
        [
            "0,1",
            "h100-00/0,h100-00/1",
            "0.2,0.1",
            "hgx-h100",
            "H100-SXM",
            "fp8",
            "auto",
            "prefill=plan.json,decode=plan.json",
            "16Gi",
            "2",
            "best-effort",
            "plan",
            "plan-0",
        ]
    )
    names = [n for n in HOSTILE_NAMES if "\x00" not in n]  # argv cannot hold NUL
    return st.one_of(
        plain,
        st.sampled_from(names),
        st.sampled_from(HOSTILE_PATHS),
        st.text(st.characters(exclude_characters="\x00"), max_size=24),
    )


def _cli_case(template: tuple[str, ...], value: str) -> Case:
    """The command line travels in ``arg`` (JSON), the value in ``data``: a saved case replays as is."""
    data = value.encode("utf-8", "surrogatepass")
    return Case(data, "value.txt", (("plan.json", plan_bytes()),), json.dumps(template), seed=template[0])


def cli_cases() -> st.SearchStrategy[Case]:
    return st.builds(_cli_case, st.sampled_from(CLI_TEMPLATES), cli_values())


def cli_seeds() -> list[Case]:
    return [_cli_case(template, "0,1") for template in CLI_TEMPLATES]


def cli_every_value() -> list[Case]:
    """Every command line with every hostile name and path (the long run's systematic part)."""
    values = [n for n in HOSTILE_NAMES if "\x00" not in n] + list(HOSTILE_PATHS)
    return [_cli_case(template, value) for template in CLI_TEMPLATES for value in values]


def run_cli_args(case: Case, folder: Path) -> None:
    value = case.data.decode("utf-8", "surrogatepass")
    add_hostile_files(folder)
    with chdir(folder):
        cli(*(value if part == "{}" else part for part in json.loads(case.arg)))


register(
    Target(
        "cli-args",
        "CLI flags and arguments (lists, names, paths) of every command",
        cases=cli_cases,
        seeds=cli_seeds,
        exhaustive=cli_every_value,
        run=run_cli_args,
        allowed=CLI_OK,
        brief_examples=30,
    )
)

"""CLI start-up (issue 17): commands are imported only when used, and the root help needs none of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from toposched.cli.main import COMMANDS, load_command

HEAVY = ("pynvml", "prometheus_client", "httpx", "fastapi", "uvicorn", "starlette", "ortools", "matplotlib")
HEAVY_OURS = ("toposched.service", "toposched.ledger.etcd", "toposched.sidecar", "toposched.sim")


def _loaded_after(argv: list[str]) -> set[str]:
    """Top-level modules (and our heavy packages) loaded by a fresh interpreter running ``argv``."""
    code = (
        "import json, sys\n"
        "from toposched.cli.main import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    mods = set(json.loads(out.stderr.strip().splitlines()[-1]))
    return {m.split(".")[0] for m in mods if m.split(".")[0] in HEAVY} | {m for m in mods if m.startswith(HEAVY_OURS)}


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["plan", "--help"],
        ["plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--json"],
        ["fit", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--json"],
    ],
)
def test_local_commands_load_no_service_nvml_etcd_or_plotting(argv: list[str]) -> None:
    assert _loaded_after(argv) == set()


def test_root_help_loads_no_command_module() -> None:
    code = (
        "import sys\nfrom toposched.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write(' '.join(m for m in sys.modules if m.startswith('toposched.cli.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stderr.split() == ["toposched.cli.main"]
    assert all(name in out.stdout for name in COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_listed_help_is_the_commands_own(name: str) -> None:
    """The one-line help in COMMANDS (shown without importing) starts the command's real help."""
    command = load_command(name)
    assert command is not None and command.name == name
    listed = COMMANDS[name][1].removesuffix("...")
    real = " ".join((command.help or "").split())
    assert real.startswith(" ".join(listed.split())), (name, real[:80])


def test_an_unknown_command_is_refused() -> None:
    assert load_command("nope") is None


def test_running_commands_again_registers_nothing_twice(run_cli) -> None:  # type: ignore[no-untyped-def]
    """Modules register their commands once, however many commands run in one process (a second
    registration would add every sub-command again and make each run slower than the last)."""
    first = run_cli("launch", "--help").stdout
    for _ in range(3):
        again = run_cli("launch", "--help").stdout
    assert again == first
    assert first.count("\n  vllm ") == 1

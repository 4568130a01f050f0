"""Progress of the long commands (``cli/progress.py``): on stderr only, a plain line per stage when stderr is
not a terminal, a Rich bar when it is, nothing with ``--quiet``.

The commands run on small inputs, with ``$TOPOSCHED_PROGRESS_AFTER_S=0`` so every stage shows however quick
(by default progress waits 2 s, tested apart). The terminal case runs the CLI in a subprocess whose stderr is
a pseudo-terminal (``pty``): Rich sees a real terminal, as an operator's would be.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.cli.test_calibrate_cli import CSV
from tests.cli.test_defrag_cli import fragmented  # noqa: F401  (the fixture)
from tests.conftest import REPO, RunCli
from toposched.cli.progress import AFTER_ENV, DEFAULT_AFTER_S, Reporter, after_s

SPEC = "name: four\nnodes:\n  - name: 'h{i}'\n    count: 4\n    preset: hgx-h100\n"
SIMULATE = ("simulate", "--scenario", "churn-tiny", "--requests", "50", "--policies", "random,slo", "--json")
DONE = re.compile(r"^(?P<cmd>[a-z ]+): (?P<label>.+) done in \d+\.\d s$")


@pytest.fixture
def at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AFTER_ENV, "0")


def stages(stderr: str, command: str) -> list[str]:
    """The stage labels of ``stderr``'s progress lines, checking each start line has its done line next."""
    lines = [line for line in stderr.splitlines() if line.startswith(f"{command}: ")]
    assert len(lines) % 2 == 0, lines
    labels = []
    for start, done in zip(lines[::2], lines[1::2], strict=True):
        assert start.endswith(" ..."), start
        m = DONE.match(done)
        assert m is not None and m["cmd"] == command, done
        assert start.startswith(f"{command}: {m['label']}"), (start, done)  # the start line may add "i/n"
        labels.append(start.removeprefix(f"{command}: ").removesuffix(" ..."))
    return labels


def untimed(text: str) -> str:
    """``simulate --json`` output without its timing (each policy's ``wall_s``, ``cpu_s``, ``events_per_s``)."""
    return re.sub(r'"(wall_s|cpu_s|events_per_s)": [0-9.e-]+', r'"\1": 0', text)


def check_plain_and_quiet(run_cli: RunCli, *args: str, same_stdout: bool = True) -> tuple[str, list[str]]:
    """Run ``args`` with and without ``--quiet``: the stdout (equal, timings aside, when ``same_stdout``) and
    the stages."""
    command = args[0] if args[0] != "ledger" else "ledger stress"
    loud = run_cli(*args)
    assert loud.exit_code == 0, loud.stderr
    quiet = run_cli(*args, "--quiet")
    assert quiet.exit_code == 0, quiet.stderr
    assert f"{command}: " not in quiet.stderr  # (c) --quiet: no progress
    assert f"{command}: " not in loud.stdout  # progress never on stdout
    if same_stdout:
        assert untimed(loud.stdout) == untimed(quiet.stdout)
    return loud.stdout, stages(loud.stderr, command)


# ------------------------------------------------------------------------------------ (a) + (c) each command


@pytest.mark.usefixtures("at_once")
def test_simulate_a_line_per_policy(run_cli: RunCli) -> None:
    stdout, labels = check_plain_and_quiet(run_cli, *SIMULATE)
    assert labels == ["policy random 1/2", "policy slo 2/2"]
    assert set(json.loads(stdout)["policies"]) == {"random", "slo"}
    assert run_cli(*SIMULATE, "-q").stderr == ""  # the short form


@pytest.mark.usefixtures("at_once")
def test_plan_stages_on_a_cluster_spec(run_cli: RunCli, tmp_path: Path) -> None:
    spec = tmp_path / "four.yaml"
    spec.write_text(SPEC)
    args = ("plan", "--cluster", str(spec), "--model", "llama-3.1-8b", "--replicas", "2")
    stdout, labels = check_plain_and_quiet(run_cli, *args, "--json")
    assert labels == [f"reading the topology (cluster:{spec})", "indexing 32 GPUs", "placing", "writing the plan"]
    assert len(json.loads(stdout)["placements"]) == 2
    human, labels = check_plain_and_quiet(run_cli, *args)
    assert labels[-1] == "placing" and "plan-1" in human


@pytest.mark.usefixtures("at_once")
@pytest.mark.parametrize("launch", [("launch", "vllm", "--format", "json"), ("launch", "k8s"), ("launch", "ray")])
def test_launch_shows_the_planning_stages(run_cli: RunCli, tmp_path: Path, launch: tuple[str, ...]) -> None:
    """A launch that plans (--model with a topology) shows plan's stages under its own name; one that reads
    --plan has nothing to show."""
    spec = tmp_path / "four.yaml"
    spec.write_text(SPEC)
    args = (*launch, "--cluster", str(spec), "--model", "llama-3.1-8b", "--replicas", "2")
    _stdout, labels = check_plain_and_quiet(run_cli, *args)
    assert labels == [f"reading the topology (cluster:{spec})", "indexing 32 GPUs", "placing"]
    plan = tmp_path / "plan.json"
    plan.write_text(run_cli("plan", "--cluster", str(spec), "--model", "llama-3.1-8b", "--json", "-q").stdout)
    from_file = run_cli(*launch, "--plan", str(plan))
    assert from_file.exit_code == 0 and "launch: " not in from_file.stderr


@pytest.mark.usefixtures("at_once")
def test_calibrate_stages(run_cli: RunCli, tmp_path: Path) -> None:
    csv = tmp_path / "bench.csv"
    csv.write_text(CSV)
    stdout, labels = check_plain_and_quiet(run_cli, "calibrate", str(csv), "--json")
    assert labels[0] == f"reading {csv} 1/1"
    assert "fitting the shared entry on 4 samples" in labels
    assert json.loads(stdout)["profile"]["entries"]


@pytest.mark.usefixtures("at_once")
def test_ledger_stress_stages(run_cli: RunCli, tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 'stress.db'}"
    args = ("ledger", "stress", "--state", url, "--ops", "40", "--clients", "2", "--json")
    stdout, labels = check_plain_and_quiet(run_cli, *args, same_stdout=False)  # ops/s differ run to run
    assert labels == [
        "setting up 8 GPUs in the store",
        "starting 2 client processes",
        "2 clients running 40 ops",
        "checking every change for double bookings",
    ]
    assert json.loads(stdout)["double_bookings"] == 0  # stdout is the JSON document alone


@pytest.mark.usefixtures("at_once")
def test_defrag_stages(run_cli: RunCli, fragmented: tuple[str, Path]) -> None:  # noqa: F811
    url, _spec = fragmented
    stdout, labels = check_plain_and_quiet(run_cli, "defrag", "--state", url, "--need-gpus", "8", "--json")
    assert labels[:4] == [
        "opening the state",
        "reading the topology",
        "rebuilding the placements on 24 GPUs",
        "looking for 8 free GPUs in one nvlink group",
    ]
    assert any(label.startswith("trying 2 move(s)") for label in labels[4:])
    assert json.loads(stdout)["status"] == "planned"


def test_a_quick_command_shows_nothing_by_default(run_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AFTER_ENV, raising=False)
    assert after_s() == DEFAULT_AFTER_S == 2.0
    result = run_cli("plan", "--preset", "hgx-h100", "--model", "llama-3.1-8b", "--json")
    assert result.exit_code == 0 and result.stderr == ""


# ------------------------------------------------------------------------------------------ the Reporter itself


def test_progress_shows_once_the_delay_is_over_from_the_running_stage() -> None:
    out = io.StringIO()
    with Reporter("demo", console=Console(file=out, width=200), after=0.05) as progress:
        progress.stage("quick")
        progress.stage("slow", step=(2, 2))
        deadline = time.monotonic() + 10
        while "slow" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)  # the timer thread prints the running stage's start line
        progress.stage("next")
    labels = stages(out.getvalue(), "demo")
    assert labels == ["slow 2/2", "next"]  # "quick" ended before the delay: never shown


def test_a_failed_stage_has_no_done_line() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), Reporter("demo", console=Console(file=out), after=0):
        raise RuntimeError("boom")
    assert out.getvalue() == ""
    with pytest.raises(RuntimeError), Reporter("demo", console=Console(file=out, width=200), after=0) as progress:
        progress.stage("work")
        raise RuntimeError("boom")
    assert out.getvalue() == "demo: work ...\n"


def test_on_a_terminal_console_it_is_a_bar_not_lines() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with Reporter("demo", console=console, after=0) as progress:
        progress.stage("counting", total=10)
        progress.update(5)
    text = out.getvalue()
    assert "demo: counting" in text and "━" in text and "\x1b[" in text
    assert "done in" not in text and "demo: counting ..." not in text


def test_a_label_is_text_not_rich_markup() -> None:
    """Labels hold file names and URLs: ``run[/x].csv`` is drawn as it is (as markup it raised MarkupError)."""
    out = io.StringIO()
    with Reporter("demo", console=Console(file=out, force_terminal=True, width=100), after=0) as progress:
        progress.stage("reading run[/x].csv [bold]", total=1)
        progress.update(1)
    assert "reading run[/x].csv [bold]" in out.getvalue()


# ------------------------------------------------------------------------------------------ (b) a real terminal


def run_on_a_terminal(*args: str) -> tuple[str, str]:
    """``toposched ARGS`` in a subprocess with stderr a pseudo-terminal: (what the terminal got, stdout)."""
    main, child = pty.openpty()
    env = {**os.environ, AFTER_ENV: "0", "COLUMNS": "100", "TERM": "xterm"}
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toposched.cli.main", *args], stdout=subprocess.PIPE, stderr=child, cwd=REPO, env=env
    )
    os.close(child)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(10)
    os.close(main)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace"), stdout.decode()


def test_on_a_terminal_simulate_shows_the_rich_bar_and_stdout_stays_the_same(run_cli: RunCli) -> None:
    terminal, stdout = run_on_a_terminal(*SIMULATE)
    assert "simulate: policy random 1/2" in terminal and "simulate: policy slo 2/2" in terminal
    assert "━" in terminal and "\x1b[" in terminal  # the bar, drawn with cursor moves
    assert "done in" not in terminal  # no plain lines on a terminal
    assert untimed(stdout) == untimed(run_cli(*SIMULATE, "--quiet").stdout)


def test_on_a_terminal_quiet_draws_nothing() -> None:
    terminal, stdout = run_on_a_terminal(*SIMULATE, "--quiet")
    assert terminal == "" and json.loads(stdout)["policies"]

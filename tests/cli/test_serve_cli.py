"""``toposched serve``: the options and the one-line errors before anything listens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RunCli
from toposched.cli.serve import FD_RESERVE, connection_limits
from toposched.service.config import ServiceConfig


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOPOSCHED_API_TOKEN", raising=False)


def test_help_lists_the_options(run_cli: RunCli) -> None:
    result = run_cli("serve", "--help")
    assert result.exit_code == 0
    flags = ("--host", "--port", "--state", "--preset", "--cluster", "--smi", "--live", "--token-file")
    for flag in (*flags, "--max-connections", "--header-timeout", "--body-timeout"):
        assert flag in result.stdout, flag


def test_no_token_is_refused_with_the_fix(run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli("serve", "--preset", "hgx-h100", "--state", f"sqlite:{tmp_path / 's.db'}")
    assert result.exit_code == 2
    assert "no API token" in result.stderr and "TOPOSCHED_API_TOKEN" in result.stderr
    assert not (tmp_path / "s.db").exists()  # nothing opened


def test_empty_token_file_is_refused(run_cli: RunCli, tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    result = run_cli("serve", "--preset", "hgx-h100", "--token-file", str(empty))
    assert result.exit_code == 2 and "is empty" in result.stderr
    missing = run_cli("serve", "--preset", "hgx-h100", "--token-file", str(tmp_path / "nope"))
    assert missing.exit_code == 2 and "--token-file" in missing.stderr


def test_bad_port_and_two_sources_name_the_flag(run_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOPOSCHED_API_TOKEN", "a-long-enough-token")
    result = run_cli("serve", "--preset", "hgx-h100", "--port", "70000")
    assert result.exit_code == 2 and "--port" in result.stderr
    result = run_cli("serve", "--preset", "hgx-h100", "--live")
    assert result.exit_code == 2 and "one topology source" in result.stderr
    result = run_cli("serve", "--preset", "hgx-h100", "--header-timeout", "0")
    assert result.exit_code == 2 and "--header-timeout" in result.stderr
    result = run_cli("serve", "--preset", "hgx-h100", "--max-connections", "2")
    assert result.exit_code == 2 and "--max-connections" in result.stderr


def test_connections_are_capped_below_the_open_file_limit(capsys: pytest.CaptureFixture[str]) -> None:
    config = ServiceConfig(token="t" * 16, max_connections=4096, header_timeout_s=3, body_timeout_s=7)
    limits = connection_limits(config, open_files=1024)
    assert limits.max_connections == 1024 - FD_RESERVE
    assert (limits.header_timeout_s, limits.body_timeout_s) == (3, 7)
    assert "open-file limit (1024)" in capsys.readouterr().err
    assert connection_limits(config, open_files=100_000).max_connections == 4096


def test_unknown_preset_fails_before_listening(
    run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOPOSCHED_API_TOKEN", "a-long-enough-token")
    result = run_cli("serve", "--preset", "hgx-h10", "--state", f"sqlite:{tmp_path / 's.db'}")
    assert result.exit_code == 2
    assert "did you mean" in result.stderr


def test_a_port_in_use_is_one_line_before_anything_starts(
    run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    monkeypatch.setenv("TOPOSCHED_API_TOKEN", "a-long-enough-token")

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("serve", "--preset", "hgx-h100", "--port", str(port), "--state", str(tmp_path / "s.db"))
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "serving on" not in result.stderr and not (tmp_path / "s.db").exists()

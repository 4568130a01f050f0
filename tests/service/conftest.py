"""Service fixtures: real ``toposched serve`` processes on free loopback ports, always stopped afterwards.

``serve(...)`` starts one (``python -m toposched.cli.main serve ...``), waits for ``/readyz`` and hands back a
``Server`` with a ready ``httpx.Client``; the fixture stops every server it started. etcd comes from the
ledger tests' real-etcd fixture (Debian ``etcd-server``; missing etcd fails, never skips).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.ledger.conftest import etcd_server, free_port

__all__ = ["etcd_server"]

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Server:
    """One ``toposched serve`` process and a client that sends the token."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {**os.environ, "TOPOSCHED_API_TOKEN": TOKEN}
        self.log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toposched.cli.main", "serve", "--port", str(self.port), *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, headers=AUTH, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"toposched serve exited with {self.proc.returncode}: {self.output()}", pytrace=False)
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"toposched serve did not become ready in 60 s: {self.output()}", pytrace=False)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


StartServer = Callable[..., Server]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """``serve(*args)`` starts a server with these CLI arguments; all are stopped after the module."""
    started: list[Server] = []
    folder = tmp_path_factory.mktemp("serve")

    def start(*args: str) -> Server:
        server = Server(list(args), folder / f"serve-{len(started)}.log")
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def sqlite_server(serve: StartServer, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One server on an hgx-h100 preset with a SQLite state file, shared by a test module."""
    state = tmp_path_factory.mktemp("state") / "state.sqlite3"
    return serve("--preset", "hgx-h100", "--state", f"sqlite:{state}")

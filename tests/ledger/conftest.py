"""Ledger fixtures: a real etcd server on free loopback ports, and a factory for every backend.

etcd is Debian's ``etcd-server`` (``/usr/bin/etcd``; ``make system-deps`` installs it). Without it the
etcd tests fail with a message that says so; they never skip, so CI cannot pass without them.

The etcd ledger has two transports (etcd's gRPC API and its JSON gateway, ``etcd_transport.connect``): the
contract tests run on both, as backends ``etcd`` (JSON gateway) and ``etcd-grpc``; tests that take the
``etcd_transport`` fixture run once per transport. The gRPC runs skip only when protobuf is not installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from toposched.ledger import open_ledger
from toposched.ledger.base import Clock, Ledger, wall_clock
from toposched.ledger.etcd_transport import Transport


def grpc_missing() -> str | None:
    """Why etcd's gRPC transport cannot be used here, or None when it can."""
    try:
        import toposched.ledger.etcd_grpc  # noqa: F401
    except ImportError as exc:
        return f"grpcio or protobuf is not installed ({exc}); pip install grpcio 'protobuf>=6.31.1,<7'"
    return None


@pytest.fixture(params=["http", "grpc"])
def etcd_transport(request: pytest.FixtureRequest) -> Transport:
    """Each of the etcd ledger's transports in turn."""
    if request.param == "grpc" and (missing := grpc_missing()):
        pytest.skip(missing)
    transport: Transport = request.param
    return transport


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """One etcd process on loopback ports with its own data folder; stop/start keeps both."""

    def __init__(self, data_dir: Path, *, tls: tuple[Path, Path] | None = None, host: str = "127.0.0.1") -> None:
        """``tls``: (certificate, key) files: etcd serves its clients over TLS (``https://``); ``host``: the
        address clients reach it at (``[::1]`` for IPv6 loopback)."""
        binary = os.environ.get("TOPOSCHED_ETCD") or shutil.which("etcd") or "/usr/bin/etcd"
        if not Path(binary).exists():
            pytest.fail(
                "etcd is not installed (looked for `etcd` on PATH and /usr/bin/etcd); "
                "install Debian's etcd-server: `make system-deps` or `apt-get install -y etcd-server`",
                pytrace=False,
            )
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://{host}:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name=test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                *([f"--cert-file={self.tls[0]}", f"--key-file={self.tls[1]}"] if self.tls else []),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"etcd exited with {self.proc.returncode}; see {self.log.name}", pytrace=False)
            try:
                verify = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else True
                answer = httpx.post(f"{self.url}/v3/kv/range", json={"key": "eA=="}, timeout=1, verify=verify)
                if answer.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"etcd did not answer at {self.url} within 20 s; see {self.log.name}", pytrace=False)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.log.close()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with tempfile.TemporaryDirectory(prefix="toposched-etcd-") as tmp:
        server = EtcdServer(Path(tmp) / "data")
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def etcd_url(etcd_server: EtcdServer) -> str:
    """The session's etcd with a namespace of this test's own."""
    return f"{etcd_server.url}/t{uuid.uuid4().hex[:12]}"


BACKEND_NAMES = ("memory", "sqlite", "etcd", "etcd-grpc")
LedgerFactory = Callable[..., Ledger]


@pytest.fixture(params=BACKEND_NAMES)
def make_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LedgerFactory]:
    """``make_ledger(capacities, clock=...)``: a fresh, empty ledger of the parametrised backend."""
    opened: list[Ledger] = []
    name = request.param
    if name == "etcd-grpc" and (missing := grpc_missing()):
        pytest.skip(missing)

    def make(capacities: Mapping[str, int], *, clock: Clock = wall_clock) -> Ledger:
        if name == "memory":
            url = "memory"
        elif name == "sqlite":
            url = f"sqlite:{tmp_path / uuid.uuid4().hex}.sqlite3"
        else:
            from toposched.ledger.etcd import EtcdLedger

            server: EtcdServer = request.getfixturevalue("etcd_server")
            transport: Transport = "grpc" if name == "etcd-grpc" else "http"
            ledger = EtcdLedger(f"{server.url}/t{uuid.uuid4().hex[:12]}", clock=clock, transport=transport)
            ledger.set_capacity(capacities)
            opened.append(ledger)
            return ledger
        ledger = open_ledger(url, clock=clock)
        ledger.set_capacity(capacities)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        ledger.close()

"""A holder killed with SIGKILL: once its lease runs out, the capacity is back (SQLite and etcd)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ledger.conftest import EtcdServer
from toposched.ledger import open_ledger
from toposched.ledger.base import GIB

HOLDER = """
import sys, time
from toposched.ledger import open_ledger
ledger = open_ledger(sys.argv[1])
for i in range(3):
    assert ledger.reserve(f"crash-{i}", {"n/0": 10 * 2**30, "n/1": 10 * 2**30}, ttl_s=2, owner="holder").ok
print("held", flush=True)
while True:
    ledger.renew("crash-0", 2)  # a live holder keeps renewing; the kill stops it
    time.sleep(0.5)
"""


@pytest.mark.parametrize("backend", ["sqlite", "etcd"])
def test_sigkilled_holder_frees_capacity_after_ttl(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        url = f"sqlite:{tmp_path / 'state.sqlite3'}"
    else:
        server: EtcdServer = request.getfixturevalue("etcd_server")
        url = f"etcd:{server.url}/crash{os.getpid()}{time.monotonic_ns()}"
    ledger = open_ledger(url)
    ledger.set_capacity({"n/0": 80 * GIB, "n/1": 80 * GIB})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert ledger.accounts()["n/0"].reserved_bytes == 30 * GIB
        time.sleep(2.5)
        assert ledger.get("crash-0") is not None  # renewed while its holder lived
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 8
    while ledger.accounts()["n/0"].reserved_bytes and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {ref: a.reserved_bytes for ref, a in ledger.accounts().items()} == {"n/0": 0, "n/1": 0}
    assert ledger.reserve("after", {"n/0": 80 * GIB}).ok
    expired = sorted(e.id for e in ledger.audit() if e.action == "expire")
    assert expired == ["crash-0", "crash-1", "crash-2"]
    ledger.close()

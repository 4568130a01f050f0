"""Reservations per second of each persistent ledger backend with 1, 4 and 16 client processes.

    .venv/bin/python benchmarks/ledger_bench.py [--ops N] [--repeat R] [--endpoint http://HOST:PORT]

Each figure is the median of R runs (default 3) of the stress load generator (``toposched ledger
stress``: 55 % reserve, 35 % release, 10 % renew on 8 GPUs, with the independent checker running).
``reservations/s`` counts successful bookings; ``ops/s`` every call. Without ``--endpoint`` an etcd
(``/usr/bin/etcd``) is started on free loopback ports in a temporary folder and stopped afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from toposched.ledger.stress import StressConfig, run_stress


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_etcd(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [
            binary,
            "--name=bench",
            f"--data-dir={data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=bench={peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            httpx.post(f"{client}/v3/kv/range", json={"key": "eA=="}, timeout=1).raise_for_status()
            return proc, client
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"etcd did not start at {client}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per run, in total")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--endpoint", help="an etcd to use instead of starting one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, endpoint = (None, args.endpoint) if args.endpoint else start_etcd(Path(tmp) / "etcd")
        try:
            print(f"{'backend':8} {'clients':>7} {'reservations/s':>15} {'ops/s':>9} {'double':>7} {'lost':>5}")
            for backend in ("sqlite", "etcd"):
                for clients in (1, 4, 16):
                    runs = []
                    for i in range(args.repeat):
                        url = f"sqlite:{tmp}/{clients}-{i}.sqlite3" if backend == "sqlite" else f"etcd:{endpoint}/b{i}"
                        runs.append(run_stress(StressConfig(url=url, clients=clients, ops=args.ops, seed=i)))
                    res = statistics.median(r["reservations_per_s"] for r in runs)
                    ops = statistics.median(r["ops_per_s"] for r in runs)
                    bad = sum(r["double_bookings"] for r in runs)
                    lost = sum(r["lost"] for r in runs)
                    print(f"{backend:8} {clients:>7} {res:>15.0f} {ops:>9.0f} {bad:>7} {lost:>5}", flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()

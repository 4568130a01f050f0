"""Reservations per second of each persistent ledger backend with 1, 4 and 16 client processes.

    .venv/bin/python benchmarks/ledger_bench.py [--ops N] [--repeat R] [--seed S] [--backend sqlite,etcd,etcd-grpc]
                                                [--clients 1,4,16] [--endpoint http://HOST:PORT]

Each figure is the median of R runs (default 3) of the stress load generator (``toposched ledger
stress``: 55 % reserve, 35 % release, 10 % renew on 8 GPUs, with the independent checker running).
``reservations/s`` counts successful bookings; ``ops/s`` every call. CPU per operation, in ms:
``client`` is the client processes and the checker together (their own reports of the CPU their work
took, which leave out a spawned process's imports; the rusage of the children with a ``stress`` that does
not report it), ``checker`` the checker's share
of it (it reads in a loop while the clients run, so its CPU follows the run's length more than the number
of operations; ``-`` with a ``stress`` that does not report it), ``etcd`` the etcd server's (from ``/proc``;
only when the script started it), ``total`` client and etcd added. Run ``r`` uses seed ``--seed`` + r.
Backend ``etcd`` is the etcd ledger over etcd's JSON gateway, ``etcd-grpc`` over its gRPC API
(``TOPOSCHED_ETCD_TRANSPORT``, which the clients inherit). The backends take turns within each
repetition (sqlite, etcd, etcd-grpc, sqlite, ...), so a change in the machine's load falls on all of them
alike. On a machine with few cores the wall figures are bounded by the sum of the two. Every run books in
a new ledger (a new SQLite file, a new etcd namespace): etcd's ``audit()``, which the checker calls in a
loop, reads its namespace's whole log. Without ``--endpoint`` an etcd (``/usr/bin/etcd``) is started on
free loopback ports in a temporary folder and stopped afterwards. The first line says which ``toposched``
runs: with ``PYTHONPATH`` pointing at another checkout's ``src``, the same script measures that code (one
without gRPC: ``--backend etcd``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

import toposched
from toposched.ledger.stress import StressConfig, run_stress

TRANSPORT_ENV = "TOPOSCHED_ETCD_TRANSPORT"  # as in toposched.ledger.etcd_transport, which older code lacks

BACKENDS = ("sqlite", "etcd", "etcd-grpc")


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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_run(cfg: StressConfig, server_pid: int | None) -> dict[str, Any]:
    """One stress run, with the CPU its processes (and the etcd server, if ours) spent per operation."""
    server_before = process_cpu_s(server_pid) if server_pid else 0.0
    clients_before = children_cpu_s()
    result = run_stress(cfg)
    ops = max(1, result["ops"])
    if "client_cpu_s" in result:  # the clients' and the checker's own reports (spawned clients' imports left out)
        result["client_cpu_ms"] = (result["client_cpu_s"] + result["checker_cpu_s"]) / ops * 1e3
    else:  # code before the reports (the code before issue 17: forked clients, RUSAGE_CHILDREN)
        result["client_cpu_ms"] = (children_cpu_s() - clients_before) / ops * 1e3
    result["server_cpu_ms"] = (process_cpu_s(server_pid) - server_before) / ops * 1e3 if server_pid else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per run, in total")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the first run (run r: seed + r)")
    parser.add_argument(
        "--backend",
        default=",".join(
            BACKENDS
            if importlib.util.find_spec("google.protobuf") and importlib.util.find_spec("grpc")
            else BACKENDS[:2]
        ),
        help=f"comma-separated, of {', '.join(BACKENDS)} (default: all; etcd-grpc only with grpcio and protobuf)",
    )
    parser.add_argument("--clients", default="1,4,16", help="client process counts, comma-separated")
    parser.add_argument("--endpoint", help="an etcd to use instead of starting one")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if unknown := sorted(set(backends) - set(BACKENDS)):
        parser.error(f"unknown backend {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    counts = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        need_etcd = any(b.startswith("etcd") for b in backends) and not args.endpoint
        proc, endpoint = start_etcd(Path(tmp) / "etcd") if need_etcd else (None, args.endpoint)
        try:
            print(f"toposched from {Path(toposched.__file__).parent}; load average {os.getloadavg()[0]:.1f}")
            print(
                f"{'backend':9} {'clients':>7} {'reservations/s':>15} {'ops/s':>9} {'double':>7} {'lost':>5} "
                f"{'client CPU ms/op':>17} {'checker':>8} {'etcd CPU ms/op':>15} {'total CPU ms/op':>16}"
            )
            for clients in counts:
                runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
                for i in range(args.repeat):
                    for backend in backends:  # in turns: load drift falls on every backend alike
                        # a fresh ledger per run: etcd's audit() reads the whole log of its namespace
                        name = f"{clients}-{i}-{uuid.uuid4().hex[:6]}"
                        url = f"sqlite:{tmp}/{name}.sqlite3" if backend == "sqlite" else f"etcd:{endpoint}/b{name}"
                        os.environ[TRANSPORT_ENV] = "grpc" if backend == "etcd-grpc" else "http"
                        server = proc.pid if backend != "sqlite" and proc is not None else None
                        cfg = StressConfig(url=url, clients=clients, ops=args.ops, seed=args.seed + i)
                        runs[backend].append(measured_run(cfg, server))
                for backend, done in runs.items():
                    res = statistics.median(r["reservations_per_s"] for r in done)
                    ops = statistics.median(r["ops_per_s"] for r in done)
                    bad = sum(r["double_bookings"] for r in done)
                    lost = sum(r["lost"] for r in done)
                    client_cpu = statistics.median(r["client_cpu_ms"] for r in done)
                    checker = "-"
                    if "checker_cpu_s" in done[0]:
                        checker = f"{statistics.median(r['checker_cpu_s'] / r['ops'] * 1e3 for r in done):.2f}"
                    server_cpu, total_cpu = "-", "-"
                    if done[0]["server_cpu_ms"] is not None:
                        server_cpu = f"{statistics.median(r['server_cpu_ms'] for r in done):.2f}"
                        total_cpu = f"{statistics.median(r['client_cpu_ms'] + r['server_cpu_ms'] for r in done):.2f}"
                    print(
                        f"{backend:9} {clients:>7} {res:>15.0f} {ops:>9.0f} {bad:>7} {lost:>5} "
                        f"{client_cpu:>17.2f} {checker:>8} {server_cpu:>15} {total_cpu:>16}",
                        flush=True,
                    )
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()

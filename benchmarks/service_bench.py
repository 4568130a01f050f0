"""Loopback load test of ``toposched serve``: place + release pairs per second, SQLite and etcd.

    .venv/bin/python benchmarks/service_bench.py [--pairs 4000] [--clients 4] [--backend sqlite|etcd|both]

Starts one server (``--preset hgx-h100``) on a free loopback port for each backend (etcd: Debian's
``/usr/bin/etcd`` on free ports in a temporary folder), then ``--clients`` processes each run a share of
``--pairs`` sequential ``POST /v1/placements`` + ``DELETE /v1/placements/{id}`` pairs on one keep-alive
connection (``http.client``: the lightest client, so the figure is the server's). Every answer is checked
(201 then 200). Prints one line per backend; ``--json`` prints the figures as JSON. Bounded: at most
``--pairs`` pairs, at most ``--timeout`` seconds per backend.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "bench-token-0123456789"
BODY = json.dumps({"model": "llama-3.1-8b", "replicas": 1})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {seconds:g} s")


def start_etcd(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [
            binary, "--name=bench", f"--data-dir={folder / 'etcd'}", f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}", f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}", f"--initial-cluster=bench={peer_url}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_ready_etcd(url, proc)
    return proc, url


def wait_ready_etcd(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("etcd exited")
        try:
            if httpx.post(f"{url}/v3/kv/range", json={"key": "eA=="}, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("etcd did not start")


def start_server(state: str, port: int, folder: Path) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / "toposched"
    env = {**os.environ, "TOPOSCHED_API_TOKEN": TOKEN}
    log = open(folder / f"serve-{port}.log", "wb")  # noqa: SIM115 (lives as long as the process)
    proc = subprocess.Popen(
        [str(exe), "serve", "--port", str(port), "--preset", "hgx-h100", "--state", state],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    return proc


def client(port: int, n: int, prefix: str, out: multiprocessing.Queue[tuple[int, int]]) -> None:
    """``n`` place+release pairs on one keep-alive connection; reports (good pairs, bad answers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    good = bad = 0
    for i in range(n):
        body = json.dumps({"model": "llama-3.1-8b", "replicas": 1, "id": f"{prefix}-{i}"})
        conn.request("POST", "/v1/placements", body, headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != 201:
            bad += 1
            continue
        pid = json.loads(data)["id"]
        conn.request("DELETE", f"/v1/placements/{pid}", headers=headers)
        r = conn.getresponse()
        r.read()
        good += r.status == 200
        bad += r.status != 200
    out.put((good, bad))


def run_load(port: int, pairs: int, clients: int, timeout: float) -> dict[str, float]:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[tuple[int, int]] = ctx.Queue()
    share = [pairs // clients + (1 if k < pairs % clients else 0) for k in range(clients)]
    procs = [
        ctx.Process(target=client, args=(port, share[k], f"c{k}-{time.monotonic_ns()}", out)) for k in range(clients)
    ]
    started = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    seconds = time.perf_counter() - started
    for p in procs:
        p.join(5)
    good = sum(g for g, _ in results)
    bad = sum(b for _, b in results)
    return {"pairs": good, "bad_answers": bad, "seconds": round(seconds, 3), "pairs_per_s": round(good / seconds, 1)}


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(backend: str, pairs: int, clients: int, timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="toposched-bench-") as tmp:
        folder = Path(tmp)
        etcd = None
        if backend == "etcd":
            etcd, url = start_etcd(folder)
            state = f"etcd:{url}/bench"
        else:
            state = f"sqlite:{folder / 'state.sqlite3'}"
        port = free_port()
        server = start_server(state, port, folder)
        try:
            run_load(port, min(50, pairs), 1, timeout)  # warm up (catalog, candidates cache, connections)
            return {"backend": backend, "clients": clients, **run_load(port, pairs, clients, timeout)}  # type: ignore[dict-item]
        finally:
            stop(server)
            if etcd is not None:
                stop(etcd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--etcd-pairs", type=int, default=600, help="pairs for etcd (slower: fsync per change)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--backend", choices=("sqlite", "etcd", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    backends = ("sqlite", "etcd") if args.backend == "both" else (args.backend,)
    rows = []
    for backend in backends:
        pairs = args.pairs if backend == "sqlite" else args.etcd_pairs
        rows.append(bench(backend, pairs, args.clients, args.timeout))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'backend':8} {'clients':>7} {'pairs':>6} {'seconds':>8} {'pairs/s':>8} {'bad':>4}")
    for r in rows:
        print(
            f"{r['backend']!s:8} {r['clients']:>7} {r['pairs']:>6} {r['seconds']:>8} {r['pairs_per_s']:>8} "
            f"{r['bad_answers']:>4}"
        )


if __name__ == "__main__":
    main()

"""Load test of ``toposched serve``: create + delete pairs from an async client, with the server's CPU per pair.

    .venv/bin/python benchmarks/service_bench.py [--backend sqlite|etcd|both] [--concurrency 1,8,32]
        [--pairs 600] [--repeat 3] [--gpus 256] [--live-gpus 1280] [--live 1000] [--json]
    .venv/bin/python benchmarks/service_bench.py --tick [--backend ...] [--live-gpus 1280] [--live 1000]
        [--ticks 30]
    .venv/bin/python benchmarks/service_bench.py --concurrency 8 --live 0 --healthz 2000 --profile serve.prof
    .venv/bin/python benchmarks/service_bench.py --against /tmp/old/src [--repeat 5] [...]
    .venv/bin/python benchmarks/service_bench.py --concurrency 32 --live 0 --client aiohttp --client-procs 2 --rate 300

Starts one server (``toposched serve``: uvicorn, a process of its own) per backend and cluster on a free
loopback port, on a cluster spec of HGX H100 nodes (SQLite state in a temporary folder; etcd: Debian's
``/usr/bin/etcd`` on free loopback ports). The client is this process: ``httpx.AsyncClient`` with as many
tasks (and keep-alive connections) as the concurrency, each running ``POST /v1/placements`` (llama-3.1-8b,
one GPU) then ``DELETE /v1/placements/{id}``; every answer is checked (201 then 200).

``--client aiohttp`` sends the same requests through aiohttp, which costs the client about a quarter of
httpx's CPU; ``--client-procs P`` shares the pairs and the tasks out between P client processes (forked
once, a pool), so that the client is not what limits the pairs per second on a machine with few cores.
``--rate R`` offers R pairs per second (pair n starts no earlier than n / R seconds after the first; a task
that falls behind starts its next at once) instead of as many as the server answers: the throughput
target's form, "R pairs per second at concurrency C with p99 under X". ``p50 ms`` and ``p99 ms`` are over
every request of the run (a create and a delete are two requests).

Why the server's CPU: on a machine with few cores the client's own CPU slows the server down, so pairs
per second measure both. ``server ms/pair`` is the server process's CPU (user + system, from ``/proc``)
over a measured run divided by its pairs: the figure the service is judged by. It includes the
server's background ticks during the run. ``client ms/pair`` is this process's CPU, for comparison.
``commits/pair`` (SQLite): the ledger's fsync-ed commits per pair, read from its ``FILE-commits`` mark
before and after the run (2: one per change; a version that shares commits between changes shows fewer).

Rows: the ``--gpus`` cluster with no other placement at each concurrency, then the ``--live-gpus``
cluster with no other placement and with ``--live`` placements held (booked before the measured runs)
at the middle concurrency, so the CPU per pair can be compared as live placements grow. Each figure is
the median of ``--repeat`` runs of ``--pairs`` pairs on the same server, after a warm-up run.

``--healthz N``: one more row per server, ``N`` requests of ``GET /healthz`` (no token, no state work) at the
middle concurrency, with the server's CPU per request: what uvicorn, the guards and FastAPI cost on their own.

``--profile FILE``: run each server under cProfile with a CPU-time clock (``time.process_time``; the main
thread, where the SQLite state's work runs) and write its statistics to ``FILE`` (``FILE.2``, ... for the
later servers) when it stops; read them with ``python -m pstats FILE``. The profiler slows the server
down several times: its CPU figures are not the service's.

``--against SRC``: paired runs, for comparing two versions on a busy machine (load moves the figures as much
as a change does). Two servers on the same cluster and SQLite state, this tree's and one running the package
in the folder ``SRC`` (``PYTHONPATH``; e.g. ``git archive HEAD | tar -x -C /tmp/old`` gives ``/tmp/old/src``),
both up at once; each round measures one run on each, the order swapped every round. Rows as above; each
gives the median server ms per pair of each side, the median of the per-round ratios (this / against) and
the median load average (1 minute) over the rounds.

``--tick``: the background tick, in process (``ServiceState`` without HTTP), on the ``--live-gpus``
cluster with no placement and with ``--live`` placements held. Each round: the replica makes one change of
its own (a create + delete pair), the tick runs, then the ``follow()`` the next decision makes (its CPU,
and the resyncs it triggered: 0 when it knows the entries are its own), then a tick with nothing changed
(``tick ms CPU``: following the audit log, the DomainMap version check, the queue; a full resync only when
one is due, which the default ``resync_interval_s`` never makes it in a run this short), then one more
``resync()`` (``resync ms``: what the safety net's full resync, or a change by another replica, costs).
Medians of ``--ticks`` rounds, CPU time of this process (``time.process_time``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

TOKEN = "bench-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
GPUS_PER_NODE = 8  # an HGX H100 node


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(check: str, proc: subprocess.Popen[bytes], *, post: bool = False, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{check}: the process exited with {proc.returncode}")
        try:
            answer = httpx.post(check, json={"key": "eA=="}, timeout=1) if post else httpx.get(check, timeout=1)
            if answer.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{check} did not answer within {seconds:g} s")


def start_etcd(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    url, peer_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            binary, "--name=bench", f"--data-dir={folder / 'etcd'}", f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}", f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}", f"--initial-cluster=bench={peer_url}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_ready(f"{url}/v3/kv/range", proc, post=True)
    return proc, url


def cluster_spec(folder: Path, gpus: int) -> Path:
    """A cluster spec of ``gpus / 8`` HGX H100 nodes (as ``cluster-32x-hgx-h100`` for 256)."""
    if gpus % GPUS_PER_NODE:
        raise SystemExit(f"--gpus {gpus}: give a multiple of {GPUS_PER_NODE} (whole HGX H100 nodes)")
    path = folder / f"cluster-{gpus}.yaml"
    path.write_text(
        "name: bench\nfabric: {kind: IB, nic_gbps: 50, nics_per_node: 8, rail_optimized: true}\n"
        f'nodes:\n  - {{name: "gpu-{{i:04d}}", count: {gpus // GPUS_PER_NODE}, preset: hgx-h100, '
        "rack: rack0, zone: zone-a}\n"
    )
    return path


PROFILED_SERVER = """
import cProfile, signal, sys, time
from toposched.cli.main import main
out, sys.argv = sys.argv[1], ["toposched", *sys.argv[2:]]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn raises it again once it has stopped
profiler = cProfile.Profile(time.process_time)
try:
    profiler.runcall(main)
except SystemExit:
    pass
finally:
    profiler.dump_stats(out)
"""


def start_server(
    state: str, spec: Path, folder: Path, *, profile: str | None = None, source: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``toposched serve`` on a free port (under cProfile, writing ``profile``, when given; the package
    from the ``source`` folder, e.g. another checkout's ``src``, when given)."""
    exe = Path(sys.executable).parent / "toposched"
    port = free_port()
    log = open(folder / f"serve-{port}.log", "wb")  # noqa: SIM115 (lives as long as the process)
    command = [str(exe)] if profile is None else [sys.executable, "-c", PROFILED_SERVER, profile]
    env = {**os.environ, "TOPOSCHED_API_TOKEN": TOKEN}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        [*command, "serve", "--port", str(port), "--cluster", str(spec), "--state", state],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/readyz", proc)
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _due(at: float | None) -> None:
    """Wait for a pair's start time (``--rate``); None: at once."""
    if at is not None and (delay := at - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


async def _pairs(
    client: httpx.AsyncClient, ids: list[str], bad: list[str], waits: list[float], starts: list[float | None]
) -> None:
    """Create and delete each of ``ids`` in turn, each not before its start time; wrong answers go to ``bad``,
    each request's seconds to ``waits``."""
    for pid, at in zip(ids, starts, strict=True):
        await _due(at)
        body = {"model": "llama-3.1-8b", "replicas": 1, "id": pid}
        began = time.perf_counter()
        created = await client.post("/v1/placements", json=body)
        middle = time.perf_counter()
        waits.append(middle - began)
        if created.status_code != 201:
            bad.append(f"POST {pid}: {created.status_code} {created.text[:200]}")
            continue
        deleted = await client.delete(f"/v1/placements/{pid}")
        waits.append(time.perf_counter() - middle)
        if deleted.status_code != 200:
            bad.append(f"DELETE {pid}: {deleted.status_code} {deleted.text[:200]}")


async def _pairs_aiohttp(
    session: Any, ids: list[str], bad: list[str], waits: list[float], starts: list[float | None]
) -> None:
    """``_pairs`` through aiohttp (``--client aiohttp``)."""
    for pid, at in zip(ids, starts, strict=True):
        await _due(at)
        body = {"model": "llama-3.1-8b", "replicas": 1, "id": pid}
        began = time.perf_counter()
        async with session.post("/v1/placements", json=body) as created:
            text = await created.read()
        middle = time.perf_counter()
        waits.append(middle - began)
        if created.status != 201:
            bad.append(f"POST {pid}: {created.status} {text[:200]!r}")
            continue
        async with session.delete(f"/v1/placements/{pid}") as deleted:
            text = await deleted.read()
        waits.append(time.perf_counter() - middle)
        if deleted.status != 200:
            bad.append(f"DELETE {pid}: {deleted.status} {text[:200]!r}")


async def _hold(
    client: httpx.AsyncClient, ids: list[str], bad: list[str], waits: list[float], starts: list[float | None]
) -> None:
    for pid in ids:
        created = await client.post("/v1/placements", json={"model": "llama-3.1-8b", "replicas": 1, "id": pid})
        if created.status_code != 201:
            bad.append(f"POST {pid}: {created.status_code} {created.text[:200]}")


async def load(
    url: str,
    prefix: str,
    pairs: int,
    concurrency: int,
    *,
    hold: bool = False,
    client: str = "httpx",
    rate: float | None = None,
) -> tuple[list[str], list[float]]:
    """``pairs`` create + delete pairs (or, with ``hold``, creates only) by ``concurrency`` tasks; the
    wrong answers and each request's seconds. With ``rate`` (pairs per second) pair n starts no earlier than
    n / rate seconds after the first (an open load: a task that falls behind starts its next pair at once)."""
    bad: list[str] = []
    waits: list[float] = []
    shares = [[f"{prefix}-{k}-{i}" for i in range(k, pairs, concurrency)] for k in range(concurrency)]
    zero = time.perf_counter()
    starts: list[list[float | None]] = [
        [zero + n / rate if rate else None for n in range(k, pairs, concurrency)] for k in range(concurrency)
    ]
    if client == "aiohttp" and not hold:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=concurrency)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(url, headers=HEADERS, connector=connector, timeout=timeout) as session:
            jobs = (_pairs_aiohttp(session, ids, bad, waits, at) for ids, at in zip(shares, starts, strict=True))
            await asyncio.gather(*jobs)
        return bad, waits
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, limits=limits, timeout=60) as http:
        tasks = ((_hold if hold else _pairs)(http, ids, bad, waits, at) for ids, at in zip(shares, starts, strict=True))
        await asyncio.gather(*tasks)
    return bad, waits


def _load_in_process(
    url: str, prefix: str, pairs: int, concurrency: int, client: str, rate: float | None
) -> tuple[list[str], list[float], float]:
    """``load`` in a client process of ``--client-procs``: its wrong answers, waits and CPU seconds."""
    cpu = time.process_time()
    bad, waits = asyncio.run(load(url, prefix, pairs, concurrency, client=client, rate=rate))
    return bad, waits, time.process_time() - cpu


async def _gets(url: str, path: str, count: int, concurrency: int) -> list[str]:
    """``count`` GETs of ``path`` by ``concurrency`` tasks (no token); the wrong answers."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    bad: list[str] = []

    async def task(n: int) -> None:
        for _ in range(n):
            answer = await client.get(path)
            if answer.status_code != 200:
                bad.append(f"GET {path}: {answer.status_code} {answer.text[:200]}")

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        await asyncio.gather(*(task(len(range(k, count, concurrency))) for k in range(concurrency)))
    return bad


def measure_healthz(server: subprocess.Popen[bytes], url: str, count: int, concurrency: int) -> dict[str, float]:
    """Server and client CPU per ``GET /healthz`` (ms), and requests per second."""
    server_cpu, client_cpu, began = process_cpu_s(server.pid), time.process_time(), time.perf_counter()
    bad = asyncio.run(_gets(url, "/healthz", count, concurrency))
    seconds = time.perf_counter() - began
    if bad:
        raise SystemExit(f"{len(bad)} wrong answers, first: {bad[0]}")
    return {
        "pairs_per_s": count / seconds,
        "server_ms": (process_cpu_s(server.pid) - server_cpu) / count * 1e3,
        "client_ms": (time.process_time() - client_cpu) / count * 1e3,
    }


def ledger_commits(mark: Path) -> int:
    """The SQLite ledger's commit count, from its ``FILE-commits`` mark (written after every commit)."""
    return int(mark.read_text().split()[2])


CLIENT: dict[str, Any] = {"kind": "httpx", "procs": 1, "rate": None}  # --client, --client-procs, --rate
_POOL: ProcessPoolExecutor | None = None


def _client_pool() -> ProcessPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(CLIENT["procs"], mp_context=multiprocessing.get_context("fork"))
    return _POOL


def measure(
    server: subprocess.Popen[bytes], url: str, run: str, pairs: int, concurrency: int, mark: Path | None = None
) -> dict[str, float]:
    """One measured run: wall seconds, the server's and the client's CPU, each request's time (p50, p99), and
    with ``mark`` (SQLite's ``FILE-commits``) the ledger's fsync-ed commits per pair (2: one per change).
    With ``--client-procs P`` the pairs and the tasks are shared out between P client processes."""
    commits = ledger_commits(mark) if mark is not None else 0
    procs, kind, rate = min(int(CLIENT["procs"]), concurrency), str(CLIENT["kind"]), CLIENT["rate"]
    server_cpu, client_cpu, began = process_cpu_s(server.pid), time.process_time(), time.perf_counter()
    if procs == 1:
        bad, waits = asyncio.run(load(url, run, pairs, concurrency, client=kind, rate=rate))
        client_s = time.process_time() - client_cpu
    else:
        pool = _client_pool()
        jobs = []
        for j in range(procs):
            share, tasks = len(range(j, pairs, procs)), len(range(j, concurrency, procs))
            share_rate = rate * share / pairs if rate else None
            jobs.append(pool.submit(_load_in_process, url, f"{run}-p{j}", share, tasks, kind, share_rate))
        bad, waits, client_s = [], [], 0.0
        for job in jobs:
            one_bad, one_waits, one_cpu = job.result()
            bad += one_bad
            waits += one_waits
            client_s += one_cpu
    seconds = time.perf_counter() - began
    if bad:
        raise SystemExit(f"{len(bad)} wrong answers, first: {bad[0]}")
    waits.sort()
    result = {
        "pairs_per_s": pairs / seconds,
        "server_ms": (process_cpu_s(server.pid) - server_cpu) / pairs * 1e3,
        "client_ms": client_s / pairs * 1e3,
        "p50_ms": waits[len(waits) // 2] * 1e3,
        "p99_ms": waits[min(len(waits) - 1, int(len(waits) * 0.99))] * 1e3,
    }
    if mark is not None:
        result["commits_per_pair"] = (ledger_commits(mark) - commits) / pairs
    return result


def bench(
    backend: str,
    gpus: int,
    live: int,
    concurrencies: list[int],
    pairs: int,
    repeat: int,
    *,
    show: bool,
    healthz: int = 0,
    profile: str | None = None,
) -> list[dict[str, Any]]:
    """The rows of one server: ``live`` placements held, then each concurrency (then ``GET /healthz``)."""
    if live + max(concurrencies) > gpus:
        raise SystemExit(f"{live} live placements and {max(concurrencies)} in flight need more than {gpus} GPUs")
    with tempfile.TemporaryDirectory(prefix="toposched-bench-") as tmp:
        folder = Path(tmp)
        etcd = None
        if backend == "etcd":
            etcd, etcd_url = start_etcd(folder)
            state = f"etcd:{etcd_url}/bench"
            mark = None
        else:
            state = f"sqlite:{folder / 'state.sqlite3'}"
            mark = folder / "state.sqlite3-commits"
        server, url = start_server(state, cluster_spec(folder, gpus), folder, profile=profile)
        try:
            bad = asyncio.run(load(url, "held", live, 8, hold=True))[0] if live else []
            if bad:
                raise SystemExit(f"booking the live placements: {bad[0]}")
            rows = []
            for concurrency in concurrencies:
                measure(server, url, f"warm-{concurrency}", min(pairs, 100), concurrency)
                runs = [measure(server, url, f"c{concurrency}-r{r}", pairs, concurrency, mark) for r in range(repeat)]
                row: dict[str, Any] = {"backend": backend, "gpus": gpus, "live": live, "concurrency": concurrency}
                row |= {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                rows.append(row)
                if show:
                    print(format_row(row), flush=True)
            if healthz:
                middle = concurrencies[len(concurrencies) // 2]
                measure_healthz(server, url, min(healthz, 200), middle)
                runs = [measure_healthz(server, url, healthz, middle) for _ in range(repeat)]
                row = {"backend": backend, "gpus": gpus, "live": live, "concurrency": middle, "route": "healthz"}
                row |= {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                rows.append(row)
                if show:
                    print(format_row(row), flush=True)
            return rows
        finally:
            stop(server)
            if etcd is not None:
                stop(etcd)


def paired(
    source: str, gpus: int, live: int, concurrency: int, pairs: int, repeat: int, *, show: bool
) -> dict[str, Any]:
    """``--against``: this tree's server and one running ``source``, both up (SQLite), runs alternated
    (``repeat`` rounds, the order swapped every round); medians of each side and of the per-round ratios."""
    if live + concurrency > gpus:
        raise SystemExit(f"{live} live placements and {concurrency} in flight need more than {gpus} GPUs")
    with tempfile.TemporaryDirectory(prefix="toposched-bench-") as tmp:
        folder = Path(tmp)
        spec = cluster_spec(folder, gpus)
        servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            for side, src in (("against", source), ("this", None)):
                (folder / side).mkdir()
                servers[side] = start_server(
                    f"sqlite:{folder / side / 'state.sqlite3'}", spec, folder / side, source=src
                )
            for side, (server, url) in servers.items():
                bad = asyncio.run(load(url, "held", live, 8, hold=True))[0] if live else []
                if bad:
                    raise SystemExit(f"booking the live placements ({side}): {bad[0]}")
                measure(server, url, f"warm-{side}", min(pairs, 100), concurrency)
            ms: dict[str, list[float]] = {"against": [], "this": []}
            commits: dict[str, list[float]] = {"against": [], "this": []}
            loads = []
            for r in range(repeat):
                for side in ("against", "this") if r % 2 == 0 else ("this", "against"):
                    server, url = servers[side]
                    mark = folder / side / "state.sqlite3-commits"
                    result = measure(server, url, f"{side}-r{r}", pairs, concurrency, mark)
                    ms[side].append(result["server_ms"])
                    commits[side].append(result["commits_per_pair"])
                loads.append(os.getloadavg()[0])
        finally:
            for server, _url in servers.values():
                stop(server)
    row: dict[str, Any] = {"backend": "sqlite", "gpus": gpus, "live": live, "concurrency": concurrency}
    row |= {f"{side}_server_ms": statistics.median(values) for side, values in ms.items()}
    row |= {f"{side}_commits": statistics.median(values) for side, values in commits.items()}
    row["ratio"] = statistics.median(t / a for a, t in zip(ms["against"], ms["this"], strict=True))
    row["load_average"] = statistics.median(loads)
    if show:
        print(format_paired_row(row), flush=True)
    return row


PAIRED_HEADER = (
    f"{'GPUs':>5} {'live':>5} {'concurrency':>11} {'against ms/pair':>16} {'this ms/pair':>13} {'ratio':>6} "
    f"{'load avg':>9} {'commits/pair':>13}"
)


def format_paired_row(r: dict[str, Any]) -> str:
    commits = f"{r['against_commits']:.2f} / {r['this_commits']:.2f}"
    return (
        f"{r['gpus']:>5} {r['live']:>5} {r['concurrency']:>11} {r['against_server_ms']:>16.3f} "
        f"{r['this_server_ms']:>13.3f} {r['ratio']:>6.2f} {r['load_average']:>9.1f} {commits:>13}"
    )


HEADER = (
    f"{'backend':8} {'GPUs':>5} {'live':>5} {'concurrency':>11} {'pairs/s':>8} {'server ms/pair':>15} "
    f"{'client ms/pair':>15} {'commits/pair':>13} {'p50 ms':>7} {'p99 ms':>7}"
)


def format_row(r: dict[str, Any]) -> str:
    """One row; a ``GET /healthz`` row counts requests where the others count pairs."""
    commits = f"{r['commits_per_pair']:.2f}" if "commits_per_pair" in r else ""
    line = (
        f"{r['backend']:8} {r['gpus']:>5} {r['live']:>5} {r['concurrency']:>11} {r['pairs_per_s']:>8.0f} "
        f"{r['server_ms']:>15.3f} {r['client_ms']:>15.3f} {commits:>13}"
    )
    if "p99_ms" in r:
        line += f" {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f}"
    return line + "   (GET /healthz: per request)" if r.get("route") == "healthz" else line


def tick_bench(backend: str, gpus: int, live: int, ticks: int) -> dict[str, Any]:
    """One row of ``--tick``: a replica on a fresh state with ``live`` placements held, nothing changing."""
    from toposched.service.config import ServiceConfig
    from toposched.service.request import ServiceRequest
    from toposched.service.state import ServiceState
    from toposched.topology.sources import SourceRef

    with tempfile.TemporaryDirectory(prefix="toposched-bench-") as tmp:
        folder = Path(tmp)
        etcd = None
        if backend == "etcd":
            etcd, etcd_url = start_etcd(folder)
            url = f"etcd:{etcd_url}/bench"
        else:
            url = f"sqlite:{folder / 'state.sqlite3'}"
        source = SourceRef(kind="cluster", ref=str(cluster_spec(folder, gpus)))
        state = ServiceState(ServiceConfig(state=url, source=source, auth=False, max_queue=1))
        try:
            state.open()
            for i in range(live):
                decision = state.place(ServiceRequest(model="llama-3.1-8b", id=f"held-{i}"))
                if decision.status != "placed":
                    raise SystemExit(f"booking live placement {i}: {decision.status} {decision.reasons}")
            state.sync()  # warm-up
            tick, follow, resync, resyncs = [], [], [], []
            for i in range(ticks):
                own = ServiceRequest(model="llama-3.1-8b", id=f"own-{i}")  # this replica's own change
                if state.place(own).status != "placed" or state.release(own.id) is None:
                    raise SystemExit(f"own change {i} failed")
                if not state.sync():  # the tick after it
                    raise SystemExit(f"tick failed: {state.last_error}")
                before = state.counters.resyncs
                started = time.process_time()
                state.follow()  # the next decision's look at the log: only own entries since the tick
                follow.append(time.process_time() - started)
                resyncs.append(state.counters.resyncs - before)
                started = time.process_time()
                state.sync()  # nothing changed since the last tick
                tick.append(time.process_time() - started)
                started = time.process_time()
                state.resync()
                resync.append(time.process_time() - started)
            ms = {"tick_ms": tick, "follow_ms": follow, "resync_ms": resync}
            row: dict[str, Any] = {"backend": backend, "gpus": gpus, "live": live, "ticks": ticks}
            row |= {key: 1000 * statistics.median(values) for key, values in ms.items()}
            return row | {"follow_resyncs": sum(resyncs)}
        finally:
            state.shutdown()
            if etcd is not None:
                stop(etcd)


TICK_HEADER = (
    f"{'backend':8} {'GPUs':>5} {'live':>5} {'tick ms CPU':>12} {'follow ms':>10} {'resyncs by follow':>18} "
    f"{'resync ms':>10}"
)


def format_tick_row(r: dict[str, Any]) -> str:
    return (
        f"{r['backend']:8} {r['gpus']:>5} {r['live']:>5} {r['tick_ms']:>12.3f} {r['follow_ms']:>10.3f} "
        f"{r['follow_resyncs']:>10} of {r['ticks']:<5} {r['resync_ms']:>10.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sqlite", "etcd", "both"), default="sqlite")
    parser.add_argument("--concurrency", default="1,8,32", help="client tasks, comma-separated")
    parser.add_argument("--pairs", type=int, default=600, help="pairs per measured run")
    parser.add_argument("--etcd-pairs", type=int, default=200, help="pairs per run for etcd (fsync per change)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--live-gpus", type=int, default=1280, help="the cluster for the live-placement rows")
    parser.add_argument("--live", type=int, default=1000, help="placements held in the live rows (0: skip them)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tick", action="store_true", help="the background tick in process, nothing changed")
    parser.add_argument("--ticks", type=int, default=30, help="ticks measured per row of --tick")
    parser.add_argument("--healthz", type=int, default=0, help="also N GET /healthz per server (0: none)")
    parser.add_argument("--profile", metavar="FILE", help="run the servers under cProfile (CPU clock), stats to FILE")
    parser.add_argument(
        "--against", metavar="SRC", help="paired with a server running the package in SRC (SQLite; server CPU only)"
    )
    parser.add_argument(
        "--client", choices=("httpx", "aiohttp"), default="httpx", help="the client library (aiohttp costs less CPU)"
    )
    parser.add_argument("--client-procs", type=int, default=1, help="client processes sharing the pairs and tasks")
    parser.add_argument("--rate", type=float, help="pairs per second offered (open load; default: as fast as answered)")
    args = parser.parse_args()
    if args.client_procs < 1:
        parser.error("--client-procs must be at least 1")
    CLIENT.update(kind=args.client, procs=args.client_procs, rate=args.rate)
    profiles = iter([args.profile, *(f"{args.profile}.{n}" for n in range(2, 100))] if args.profile else [])
    backends = ("sqlite", "etcd") if args.backend == "both" else (args.backend,)
    if args.tick:
        if not args.json:
            print(TICK_HEADER, flush=True)
        tick_rows = []
        for backend in backends:
            for live in sorted({0, args.live}):
                tick_rows.append(tick_bench(backend, args.live_gpus, live, args.ticks))
                if not args.json:
                    print(format_tick_row(tick_rows[-1]), flush=True)
        if args.json:
            print(json.dumps(tick_rows, indent=2))
        return
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    middle = concurrencies[len(concurrencies) // 2]
    rows = []
    if args.against:
        if not (Path(args.against) / "toposched").is_dir():
            raise SystemExit(f"--against {args.against}: no toposched package there (give a checkout's src folder)")
        if not args.json:
            print(PAIRED_HEADER, flush=True)
        cases = [(args.gpus, 0, c) for c in concurrencies]
        if args.live:
            cases += [(args.live_gpus, 0, middle), (args.live_gpus, args.live, middle)]
        for gpus, live, concurrency in cases:
            rows.append(paired(args.against, gpus, live, concurrency, args.pairs, args.repeat, show=not args.json))
        if args.json:
            print(json.dumps(rows, indent=2))
        return
    if not args.json:
        print(HEADER, flush=True)
    for backend in backends:
        pairs = args.pairs if backend == "sqlite" else args.etcd_pairs
        show = not args.json
        extra: dict[str, Any] = {"show": show, "healthz": args.healthz}
        rows += bench(backend, args.gpus, 0, concurrencies, pairs, args.repeat, profile=next(profiles, None), **extra)
        if args.live:
            for live in (0, args.live):
                profile = next(profiles, None)
                rows += bench(backend, args.live_gpus, live, [middle], pairs, args.repeat, profile=profile, **extra)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

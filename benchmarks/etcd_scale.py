"""etcd ledger at 256 and 4,096 GPUs: time and transaction sizes of set_capacity and one reservation.

Usage: python benchmarks/etcd_scale.py [--endpoint http://127.0.0.1:2379] [--runs 5] [--transport http,grpc]
                                      [--calls 1000] [--requests-only]
Starts its own etcd (defaults: --max-txn-ops 128, --max-request-bytes 1.5 MiB) unless --endpoint is given.
Prints, per transport, cluster size and operation, the median over the runs of the client's CPU time, etcd's
CPU time (from ``/proc``, only when the script started etcd) and wall time, and the transactions it sent
(count, largest compare list, largest op list, largest request in bytes). The transports take turns run by
run, so a change in the machine's load falls on both alike. etcd's CPU from ``/proc`` comes in 10 ms clock ticks:
it says something only for the large operations (``set_capacity``, ``accounts``, reservations of many GPUs).
First it prints the CPU of one small request per transport, client and etcd, over ``--calls`` requests in a loop:
a read (one range that finds one key of 100 bytes) and a write (one put of that key).
Each run is a new ledger object, so a reserve reads before it commits, except ``reserve 8 again``: GPUs
whose keys the object remembers from its own read and commits, booked in one transaction.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ledger_bench import process_cpu_s, start_etcd  # benchmarks/ is on sys.path when run as a script

from toposched.ledger.base import GIB
from toposched.ledger.etcd import EtcdLedger
from toposched.ledger.etcd_client import Json, op_bytes, put_op, range_op
from toposched.ledger.etcd_transport import Transport, connect


def measure(ledger: EtcdLedger, call: Callable[[], Any], server: int | None = None) -> dict[str, float]:
    sent: list[tuple[int, int, int]] = []
    inner = ledger.client.txn

    def txn(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        sent.append((len(compare), len(success), op_bytes([*compare, *success])))
        return inner(compare, success, failure)

    ledger.client.txn = txn  # type: ignore[method-assign]
    etcd_cpu = process_cpu_s(server) if server else 0.0
    cpu, wall = time.process_time(), time.perf_counter()
    call()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    etcd_cpu = process_cpu_s(server) - etcd_cpu if server else float("nan")
    ledger.client.txn = inner  # type: ignore[method-assign]
    return {
        "cpu_ms": cpu * 1000,
        "etcd_ms": etcd_cpu * 1000,
        "wall_ms": wall * 1000,
        "txns": len(sent),
        "compares": max(c for c, _o, _b in sent),
        "ops": max(o for _c, o, _b in sent),
        "kib": max(b for _c, _o, b in sent) / 1024,
    }


def per_request(url: str, transport: Transport, calls: int, server: int | None) -> dict[str, tuple[float, float]]:
    """Client and etcd CPU (ms) of one small read and one small write, over ``calls`` of each in a loop."""
    client = connect(url, transport=transport)
    key = f"/bench-requests/{uuid.uuid4().hex[:8]}"
    client.txn([], [put_op(key, "v" * 100)])
    out: dict[str, tuple[float, float]] = {}
    for what, ops in (("read", [range_op(key, prefix=True)]), ("write", [put_op(key, "v" * 100)])):
        etcd_cpu = process_cpu_s(server) if server else 0.0
        cpu = time.process_time()
        for _ in range(calls):
            client.txn([], ops)
        cpu = time.process_time() - cpu
        etcd_cpu = process_cpu_s(server) - etcd_cpu if server else float("nan")
        out[what] = (cpu / calls * 1000, etcd_cpu / calls * 1000)
    client.close()
    return out


def one_run(url: str, transport: Transport, caps: dict[str, int], server: int | None) -> dict[str, dict[str, float]]:
    """Each operation once, on a new ledger object in a new namespace."""
    ledger = EtcdLedger(url, transport=transport)
    refs, gpus = sorted(caps), len(caps)
    out: dict[str, dict[str, float]] = {}
    out["set_capacity"] = measure(ledger, partial(ledger.set_capacity, caps), server)
    out["set_capacity again"] = measure(ledger, partial(ledger.set_capacity, caps), server)
    for size in (8, 72, 256, gpus):
        booked = dict.fromkeys(refs[:: gpus // size][:size], 70 * GIB)
        name = f"reserve {size}" if size < gpus else f"reserve all ({size})"
        out[name] = measure(ledger, partial(ledger.reserve, "r", booked, ttl_s=30), server)
        out[f"release {size}"] = measure(ledger, partial(ledger.release, "r"), server)
        if size == 8:  # the same GPUs again: this ledger object remembers their keys
            out["reserve 8 again"] = measure(ledger, partial(ledger.reserve, "r2", booked, ttl_s=30), server)
            out["release 8 again"] = measure(ledger, partial(ledger.release, "r2"), server)
    out["accounts"] = measure(ledger, ledger.accounts, server)
    ledger.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--transport",
        default="http,grpc" if importlib.util.find_spec("grpc") else "http",
        help="etcd transports, comma-separated: http, grpc (default: both; grpc only with grpcio installed)",
    )
    parser.add_argument("--calls", type=int, default=1000, help="small requests per transport and kind")
    parser.add_argument("--requests-only", action="store_true", help="only the small requests, not the scale table")
    args = parser.parse_args()
    transports: list[Transport] = []
    for name in args.transport.split(","):
        if name.strip() not in ("http", "grpc"):
            parser.error(f"unknown transport {name.strip()!r}; choose from http, grpc")
        transports.append("grpc" if name.strip() == "grpc" else "http")
    folder = tempfile.mkdtemp(prefix="etcd-scale-")
    proc, url = (None, args.endpoint) if args.endpoint else start_etcd(Path(folder) / "data")
    server = proc.pid if proc is not None else None
    try:
        print(f"{'via':4} {'request':8} {'client CPU ms':>14} {'etcd CPU ms':>12}")
        for _round in range(2):  # in turns, twice
            for transport in transports:
                for what, (mine, theirs) in per_request(url, transport, args.calls, server).items():
                    print(f"{transport:4} {what:8} {mine:>14.3f} {theirs:>12.3f}", flush=True)
        if args.requests_only:
            return
        print(
            f"{'via':4} {'GPUs':>5} {'operation':<22} {'CPU ms':>7} {'etcd ms':>8} {'wall ms':>8} {'txns':>5} "
            f"{'cmp':>4} {'ops':>4} {'KiB':>6}"
        )
        for gpus in (256, 4096):
            caps = {f"node-{i // 8:04d}/{i % 8}": 80 * GIB for i in range(gpus)}
            rows: dict[tuple[str, str], list[dict[str, float]]] = {}
            for _run in range(args.runs):
                for transport in transports:  # in turns: load drift falls on both alike
                    for name, measured in one_run(
                        f"{url}/bench{uuid.uuid4().hex[:8]}", transport, caps, server
                    ).items():
                        rows.setdefault((transport, name), []).append(measured)
            for (via, name), runs in sorted(rows.items(), key=lambda item: item[0][0]):
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                print(
                    f"{via:4} {gpus:>5} {name:<22} {med['cpu_ms']:>7.1f} {med['etcd_ms']:>8.1f} {med['wall_ms']:>8.1f} "
                    f"{med['txns']:>5.0f} {med['compares']:>4.0f} {med['ops']:>4.0f} {med['kib']:>6.1f}",
                    flush=True,
                )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

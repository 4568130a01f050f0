"""etcd ledger at 256 and 4,096 GPUs: time and transaction sizes of set_capacity and one reservation.

Usage: python benchmarks/etcd_scale.py [--endpoint http://127.0.0.1:2379] [--runs 5]
Starts its own etcd (defaults: --max-txn-ops 128, --max-request-bytes 1.5 MiB) unless --endpoint is given.
Prints, per cluster size and operation, the median over the runs of the client's CPU time and wall time,
and the transactions it sent (count, largest compare list, largest op list, largest request in bytes).
Each run is a new ledger object, so a reserve reads before it commits, except ``reserve 8 again``: GPUs
whose keys the object remembers from its own read and commits, booked in one transaction.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ledger_bench import start_etcd  # benchmarks/ is on sys.path when run as a script

from toposched.ledger.base import GIB
from toposched.ledger.etcd import EtcdLedger
from toposched.ledger.etcd_client import Json, op_bytes


def measure(ledger: EtcdLedger, call: Callable[[], Any]) -> dict[str, float]:
    sent: list[tuple[int, int, int]] = []
    inner = ledger.client.txn

    def txn(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        sent.append((len(compare), len(success), op_bytes([*compare, *success])))
        return inner(compare, success, failure)

    ledger.client.txn = txn  # type: ignore[method-assign]
    cpu, wall = time.process_time(), time.perf_counter()
    call()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ledger.client.txn = inner  # type: ignore[method-assign]
    return {
        "cpu_ms": cpu * 1000,
        "wall_ms": wall * 1000,
        "txns": len(sent),
        "compares": max(c for c, _o, _b in sent),
        "ops": max(o for _c, o, _b in sent),
        "kib": max(b for _c, _o, b in sent) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="etcd-scale-")
    proc, url = (None, args.endpoint) if args.endpoint else start_etcd(Path(folder) / "data")
    try:
        print(
            f"{'GPUs':>5} {'operation':<22} {'CPU ms':>7} {'wall ms':>8} {'txns':>5} {'cmp':>4} {'ops':>4} {'KiB':>6}"
        )
        for gpus in (256, 4096):
            caps = {f"node-{i // 8:04d}/{i % 8}": 80 * GIB for i in range(gpus)}
            refs = sorted(caps)
            rows: dict[str, list[dict[str, float]]] = {}
            for _run in range(args.runs):
                ledger = EtcdLedger(f"{url}/bench{uuid.uuid4().hex[:8]}")
                rows.setdefault("set_capacity", []).append(measure(ledger, partial(ledger.set_capacity, caps)))
                rows.setdefault("set_capacity again", []).append(measure(ledger, partial(ledger.set_capacity, caps)))
                for size in (8, 72, 256, gpus):
                    booked = dict.fromkeys(refs[:: gpus // size][:size], 70 * GIB)
                    name = f"reserve {size}" if size < gpus else f"reserve all ({size})"
                    rows.setdefault(name, []).append(measure(ledger, partial(ledger.reserve, "r", booked, ttl_s=30)))
                    rows.setdefault(f"release {size}", []).append(measure(ledger, partial(ledger.release, "r")))
                    if size == 8:  # the same GPUs again: this ledger object remembers their keys
                        again = partial(ledger.reserve, "r2", booked, ttl_s=30)
                        rows.setdefault("reserve 8 again", []).append(measure(ledger, again))
                        rows.setdefault("release 8 again", []).append(measure(ledger, partial(ledger.release, "r2")))
                rows.setdefault("accounts", []).append(measure(ledger, ledger.accounts))
                ledger.close()
            for name, runs in rows.items():
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                print(
                    f"{gpus:>5} {name:<22} {med['cpu_ms']:>7.1f} {med['wall_ms']:>8.1f} {med['txns']:>5.0f} "
                    f"{med['compares']:>4.0f} {med['ops']:>4.0f} {med['kib']:>6.1f}"
                )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How fast topology discovery and DomainMap building are.

    .venv/bin/python benchmarks/topology_bench.py [--repeat N]

Prints medians over N runs (default 15): parsing each readable fixture in tests/data/fixtures/topo,
building the DomainMap of presets and of synthetic clusters of 32 / 256 / 1024 HGX nodes, and a
save + load of the 256-GPU cluster in the SQLite store.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from toposched.errors import TopologyParseError
from toposched.topology.domains import build_domain_map
from toposched.topology.presets import hgx_h100_cluster, load_preset
from toposched.topology.smi import parse_topo_matrix
from toposched.topology.sources import SourceRef
from toposched.topology.store import TopologyStore

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "data" / "fixtures" / "topo"


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print(f"{'case':58s} {'median ms':>10s}")
    for path in sorted(FIXTURES.iterdir()):
        text = path.read_text()
        try:
            parse_topo_matrix(text)
        except TopologyParseError:
            continue
        print(f"parse {path.name[:52]:52s} {median_ms(lambda t=text: parse_topo_matrix(t), args.repeat):10.3f}")
    for name in ("dgx1-v100", "gb200-nvl72"):
        cluster = load_preset(name)
        print(
            f"{'domain map preset ' + name:58s} {median_ms(lambda c=cluster: build_domain_map(c), args.repeat):10.3f}"
        )
    for nodes in (32, 256, 1024):
        cluster = hgx_h100_cluster(nodes=nodes)
        ms = median_ms(lambda c=cluster: build_domain_map(c), max(3, args.repeat // 3))
        print(f"{f'domain map {nodes} x HGX H100 ({nodes * 8} GPUs)':58s} {ms:10.3f}")
    cluster = hgx_h100_cluster(nodes=32)
    with tempfile.TemporaryDirectory() as tmp:
        store = TopologyStore(Path(tmp) / "state.sqlite3")
        ref = SourceRef(kind="preset", ref="cluster-32x-hgx-h100")
        print(f"{'store save, 256 GPUs':58s} {median_ms(lambda: store.save(cluster, ref), args.repeat):10.3f}")
        print(f"{'store load latest, 256 GPUs':58s} {median_ms(store.latest, args.repeat):10.3f}")


if __name__ == "__main__":
    main()

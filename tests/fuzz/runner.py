"""Long fuzz runs and replays: ``python -m tests.fuzz.runner`` (what ``make fuzz`` runs).

    python -m tests.fuzz.runner                       # every target, 2,000 examples or 120 s each
    python -m tests.fuzz.runner --examples 5000 --seconds 600 --targets smi,nccl
    python -m tests.fuzz.runner --replay /tmp/fuzz-findings/smi-exception-ValueError-1234

Prints one row per target (cases, uncaught exceptions, inputs over 5 s, memory blow-ups, executed
injections, 5xx answers, slowest input) and the distinct findings; saves the smallest input of each
finding (shrunk by deleting lines and bytes while the same finding reproduces) under ``--findings``
with a ``finding.json`` and the traceback. Exit status 1 when anything was found.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tests.fuzz.harness import (
    Budget,
    Case,
    Finding,
    Target,
    TargetResult,
    check_case,
    env_int,
    load_case,
    replay,
    run_target,
    save_finding,
)
from tests.fuzz.targets import TARGETS

DEFAULT_EXAMPLES = env_int("TOPOSCHED_FUZZ_EXAMPLES", 2000)
DEFAULT_SECONDS = float(env_int("TOPOSCHED_FUZZ_SECONDS", 120))


def _chunks(data: bytes, lines: bool) -> list[bytes]:
    return data.splitlines(keepends=True) if lines else [data[i : i + 1] for i in range(len(data))]


def shrink(target: Target, finding: Finding, workdir: Path, *, seconds: float = 30.0, attempts: int = 400) -> Case:
    """Delete chunks of lines, then of bytes, while the same finding reproduces (a small ddmin)."""
    if finding.kind in ("hang", "memory"):
        return finding.case
    case = finding.case
    deadline = time.monotonic() + seconds

    def same(candidate: Case) -> bool:
        outcome = check_case(target, candidate, workdir)
        exc = type(outcome.error).__name__ if outcome.error is not None else "-"
        if finding.kind == "5xx":
            return outcome.kind == "5xx"
        return outcome.kind == finding.kind and exc == finding.exc_type and outcome.where == finding.where

    tries = 0
    for lines in (True, False):
        if not lines and len(case.data) > 4096:
            break
        parts = _chunks(case.data, lines)
        size = max(1, len(parts) // 2)
        while size >= 1 and tries < attempts and time.monotonic() < deadline:
            i, shrunk = 0, False
            while i < len(parts) and tries < attempts and time.monotonic() < deadline:
                candidate = replace(case, data=b"".join(parts[:i] + parts[i + size :]))
                tries += 1
                if same(candidate):
                    case, parts, shrunk = candidate, parts[:i] + parts[i + size :], True
                else:
                    i += size
            if not shrunk:
                size //= 2
    return case


def table(results: list[TargetResult]) -> str:
    """A Markdown table of the run (the one docs/fuzz.md quotes)."""
    head = (
        "| target | entry point | cases | uncaught exceptions | over 5 s | memory | injections | 5xx "
        "| slowest (CPU s) | slowest (wall s) |"
    )
    rows = [head, "|" + "---|" * 10]
    total = TargetResult("total")
    for r in results:
        c = r.counts
        rows.append(
            f"| {r.target} | {TARGETS[r.target].entry} | {r.cases:,} | {c['exception']} | {c['hang']} | "
            f"{c['memory']} | {c['injection']} | {c['5xx']} | {r.slowest_cpu_s:.2f} | "
            f"{r.slowest_wall_s:.2f} |"
        )
        total.cases += r.cases
        for k, v in c.items():
            total.counts[k] += v
        total.slowest_cpu_s = max(total.slowest_cpu_s, r.slowest_cpu_s)
        total.slowest_wall_s = max(total.slowest_wall_s, r.slowest_wall_s)
    c = total.counts
    rows.append(
        f"| **all** | | {total.cases:,} | {c['exception']} | {c['hang']} | {c['memory']} | "
        f"{c['injection']} | {c['5xx']} | {total.slowest_cpu_s:.2f} | {total.slowest_wall_s:.2f} |"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="hypothesis examples per target")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="time budget per target (0: none)")
    parser.add_argument("--targets", default="", help="comma-separated target names (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="first hypothesis seed")
    parser.add_argument("--findings", type=Path, default=Path("/tmp/fuzz-findings"), help="where inputs are saved")
    parser.add_argument("--no-shrink", action="store_true", help="save findings as found, without shrinking")
    parser.add_argument("--no-systematic", action="store_true", help="skip the every-value cases of cli-args")
    parser.add_argument("--replay", type=Path, help="run one saved finding and print its traceback")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="toposched-fuzz-") as tmp:
        work = Path(tmp)
        if args.replay:
            name, case = load_case(args.replay)
            outcome = replay(TARGETS[name], case, work)
            return 0 if outcome.kind is None else 1
        names = [n.strip() for n in args.targets.split(",") if n.strip()] or sorted(TARGETS)
        unknown = [n for n in names if n not in TARGETS]
        if unknown:
            parser.error(f"unknown target(s) {', '.join(unknown)}; valid: {', '.join(sorted(TARGETS))}")
        budget = Budget(
            examples=args.examples, seconds=args.seconds or None, seed=args.seed, exhaustive=not args.no_systematic
        )
        started = time.strftime("%Y-%m-%d %H:%M")
        results: list[TargetResult] = []
        for name in names:
            t0 = time.monotonic()
            result = run_target(TARGETS[name], budget, work)
            results.append(result)
            print(
                f"{name}: {result.cases:,} cases in {time.monotonic() - t0:.0f} s, "
                f"{sum(result.counts.values())} findings ({len(result.findings)} distinct)",
                flush=True,
            )
        findings = [f for r in results for f in r.findings.values()]
        if findings:
            args.findings.mkdir(parents=True, exist_ok=True)
        print(
            f"\nfuzz run {started}, {platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
            f"budget {budget.examples} examples / {budget.seconds or 'no'} s per target, seed {budget.seed}\n"
        )
        print(table(results))
        if findings:
            print(f"\n{len(findings)} distinct findings (smallest input of each in {args.findings}):")
        for f in findings:
            if not args.no_shrink:
                f.case = shrink(TARGETS[f.target], f, work)
                again = check_case(TARGETS[f.target], f.case, work)
                f.trace = again.trace or f.trace
            out = save_finding(f, args.findings)
            print(f"- {f.line()}\n    input: {out} ({len(f.case.data):,} bytes)")
        return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

"""The harness's oracle itself: it must see exceptions, hangs, injections and 5xx for what they are."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.harness import Budget, Case, Injection, ServerError, Target, check_case, run_target
from tests.fuzz.inject import _check_yaml, _run_script, _write_stubs
from toposched.errors import InputError


def _target(run: object, *, examples: int = 20) -> Target:
    return Target(
        "fake",
        "fake()",
        cases=lambda: st.builds(lambda b: Case(b, "in.txt"), st.binary(max_size=40)),
        seeds=lambda: [Case(b"plain text", "in.txt")],
        run=run,  # type: ignore[arg-type]
        brief_examples=examples,
    )


def test_a_user_error_passes_and_a_bug_is_a_finding_with_its_smallest_input(tmp_path: Path) -> None:
    def run(case: Case, folder: Path) -> None:
        data = (folder / case.name).read_bytes()
        if b"\x00" in data:
            raise KeyError("nul")
        if not data:
            raise InputError("empty")

    result = run_target(_target(run), Budget(examples=200, seed=0), tmp_path)
    (finding,) = result.findings.values()
    assert (finding.kind, finding.exc_type) == ("exception", "KeyError")
    assert b"\x00" in finding.case.data and finding.count == result.counts["exception"]
    assert "test_harness.py" in finding.where


def test_cpu_over_the_limit_is_a_hang_and_is_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "LIMIT_S", 0.2)

    def spin(case: Case, folder: Path) -> None:
        while True:
            sum(range(1000))

    started = time.monotonic()
    outcome = check_case(_target(spin), Case(b"x"), tmp_path)
    assert outcome.kind == "hang" and outcome.cpu_s > 0.1
    assert time.monotonic() - started < 10


def test_memory_beyond_the_bound_is_a_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "MEMORY_BOUND", 64 << 20)

    def hog(case: Case, folder: Path) -> None:
        _ = bytearray(512 << 20)

    assert check_case(_target(hog), Case(b"x"), tmp_path).kind == "memory"


def test_injection_and_server_errors_are_their_own_kinds(tmp_path: Path) -> None:
    def inject(case: Case, folder: Path) -> None:
        raise Injection("command ran")

    def fail(case: Case, folder: Path) -> None:
        raise ServerError(500, "boom")

    assert check_case(_target(inject), Case(b"x"), tmp_path).kind == "injection"
    assert check_case(_target(fail), Case(b"x"), tmp_path).kind == "5xx"


def test_the_script_oracle_sees_an_unquoted_comment_run(tmp_path: Path) -> None:
    bin_dir = _write_stubs(tmp_path)
    marker = tmp_path / "MARK"
    safe = tmp_path / "safe.sh"
    safe.write_text(f"#!/usr/bin/env bash\n# placement 'x\ntouch {marker}'\nexec vllm serve m --port 1\n")
    with pytest.raises(Injection, match="does not parse"):
        _run_script(safe, tmp_path, bin_dir, marker)
    unsafe = tmp_path / "unsafe.sh"
    unsafe.write_text(f"#!/usr/bin/env bash\n# placement x\ntouch {marker}\nexec vllm serve m --port 1\n")
    with pytest.raises(Injection, match="injected command ran"):
        _run_script(unsafe, tmp_path, bin_dir, marker)
    marker.unlink()
    good = tmp_path / "good.sh"
    good.write_text("#!/usr/bin/env bash\nexport CUDA_VISIBLE_DEVICES='0,1'\nexec vllm serve 'a b' --port 1\n")
    argv, env = _run_script(good, tmp_path, bin_dir, marker)
    assert argv == ["vllm", "serve", "a b", "--port", "1"] and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_the_yaml_oracle_sees_a_grown_key_and_broken_yaml() -> None:
    _check_yaml("kind: KubeletConfiguration\nnodes: [a]\n", "k8s")
    with pytest.raises(Injection, match="grew a key"):
        _check_yaml("nodes: [a]\n---\ninjected: /tmp/MARK\n", "k8s")
    with pytest.raises(Injection, match="not YAML"):
        _check_yaml("# nodes a\x1b\nkind: [x\n", "k8s")

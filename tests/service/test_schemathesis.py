"""Schemathesis against the live server's OpenAPI spec: no generated request gets a 5xx, and every answer is
one the spec documents (status code, content type, headers, body schema): the spec is true."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import TOKEN, Server

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)


def test_generated_requests_get_no_server_error_and_only_documented_answers(
    sqlite_server: Server, tmp_path: Path
) -> None:
    st = Path(sys.executable).parent / "st"
    if not st.exists():
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'", pytrace=False)
    done = subprocess.run(
        [
            str(st), "run", f"{sqlite_server.url}/openapi.json",
            "--header", f"Authorization: Bearer {TOKEN}",
            "--checks", ",".join(CHECKS),
            "--max-examples", "25", "--seed", "8",
            "--request-timeout", "20",
            "--report-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]
    assert "Traceback" not in sqlite_server.output()

"""A ledger file on a read-only file system (a snapshot, a backup mount) can be shown, not changed (issue 37).

The read-only mount is made in a user and mount namespace (``unshare -rm``, then a read-only bind mount of
the folder), so the file system really refuses writes even to root; skipped where namespaces are not allowed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toposched.ledger import open_ledger

GIB = 1 << 30


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(), reason="no user and mount namespaces here")


def _read_only(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``toposched ARGS`` with ``folder`` mounted read-only."""
    cli = f"{sys.executable} -m toposched.cli.main"
    script = (
        f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} && "
        f"touch {folder}/probe 2>/dev/null && echo WRITABLE; exec {cli} {' '.join(args)}"
    )
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, check=False)


def _booked(folder: Path, *, close: bool) -> Path:
    path = folder / "state.sqlite3"
    ledger = open_ledger(f"sqlite:{path}")
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("a", {"n/0": GIB}, ttl_s=None, owner="me").ok
    assert ledger.reserve("b", {"n/0": 2 * GIB}, ttl_s=None, owner="me").ok
    if close:
        ledger.close()
    return path


def test_a_closed_ledger_on_a_read_only_mount_is_shown_and_not_changed(tmp_path: Path) -> None:
    path = _booked(tmp_path, close=True)
    shown = _read_only(tmp_path, "ledger", "show", "--state", f"sqlite:{path}", "--json")
    assert "WRITABLE" not in shown.stdout and shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert sorted(r["id"] for r in body["reservations"]) == ["a", "b"]
    changed = _read_only(tmp_path, "ledger", "release", "a", "--state", f"sqlite:{path}")
    assert changed.returncode != 0 and "read-only file system: it can be shown, not changed" in changed.stderr
    assert len(open_ledger(f"sqlite:{path}").reservations()) == 2  # nothing changed


def test_a_copy_with_its_write_ahead_log_is_shown_whole(tmp_path: Path) -> None:
    """A copy taken while the writer ran: the -wal holds the commits; with its -shm SQLite reads them."""
    live = tmp_path / "live"
    live.mkdir()
    _booked(live, close=False)
    copy = tmp_path / "copy"
    shutil.copytree(live, copy)
    assert (copy / "state.sqlite3-wal").stat().st_size > 0
    shown = _read_only(copy, "ledger", "show", "--state", f"sqlite:{copy / 'state.sqlite3'}", "--json")
    assert shown.returncode == 0, shown.stderr
    assert sorted(r["id"] for r in json.loads(shown.stdout)["reservations"]) == ["a", "b"]
    (copy / "state.sqlite3-shm").unlink()  # without it the log cannot be read without writing: one clear line
    refused = _read_only(copy, "ledger", "show", "--state", f"sqlite:{copy / 'state.sqlite3'}")
    assert refused.returncode != 0 and "copy the file and its -wal and -shm files" in refused.stderr

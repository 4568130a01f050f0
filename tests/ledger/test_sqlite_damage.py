"""SQLite damage: every byte flip in the file or its WAL is refused on open or changes nothing.

Each trial copies a real ledger, flips one byte (seeded), opens the copy and compares what it serves
with the original: a ``StateError`` is *detected*, the same content is *harmless*, anything else is
*missed* (and fails the test). ``TOPOSCHED_FLIPS=N`` runs N flips of each kind instead of the
defaults (150 anywhere in the ledger's pages + 50 inside stored JSON; 40 in the WAL).
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.ledger.common import FakeClock
from toposched.errors import StateError
from toposched.ledger.base import GIB
from toposched.ledger.sqlite import SqliteLedger
from toposched.ledger.sqlite_checks import wal_damage
from toposched.ledger.sqlite_rows import row_checksum
from toposched.sqlite_file import access_problem

FLIPS = int(os.environ.get("TOPOSCHED_FLIPS", "0"))
SUFFIXES = ("", "-wal", "-commits")  # what a crash leaves (the -shm is rebuilt from the WAL)


def build(path: Path, clock: FakeClock, *, gpus: int = 64, reservations: int = 160, seed: int = 7) -> SqliteLedger:
    """A ledger with a history: reservations with and without leases, releases, renewals, expiries."""
    rng = random.Random(seed)
    refs = [f"node-{i // 8:03d}/{i % 8}" for i in range(gpus)]
    ledger = SqliteLedger(path, clock=clock)
    ledger.set_capacity(dict.fromkeys(refs, 80 * GIB))
    for i in range(reservations):
        booked = {ref: rng.randint(1, 8) * GIB for ref in rng.sample(refs, rng.choice((1, 2, 4, 8)))}
        ttl = rng.choice((None, 20.0, 3600.0))
        ledger.reserve(f"inst-{i:04d}", booked, ttl_s=ttl, owner=f"svc-{i % 3}", meta={"model": "llama-3.1-8b"})
        clock.now += 1
        if i % 4 == 0:
            ledger.release(f"inst-{i // 2:04d}")
        if i % 6 == 0:
            ledger.renew(f"inst-{i - 1:04d}", 600.0)
    clock.now += 30
    ledger.audit()  # sweeps (and logs) the leases that ran out
    return ledger


def content(ledger: SqliteLedger) -> tuple[Any, ...]:
    """Everything the ledger serves."""
    accounts = {ref: a.model_dump() for ref, a in ledger.accounts().items()}
    return accounts, [r.model_dump() for r in ledger.reservations()], [e.model_dump() for e in ledger.audit()]


def copy(source: Path, folder: Path) -> Path:
    folder.mkdir()
    for suffix in SUFFIXES:
        if Path(f"{source}{suffix}").exists():
            shutil.copyfile(f"{source}{suffix}", folder / f"{source.name}{suffix}")
    return folder / source.name


def trial(source: Path, folder: Path, clock: FakeClock, expected: tuple[Any, ...], edit: Any) -> str:
    """Copy the ledger, apply ``edit(path)``, open it: 'detected', 'harmless' or 'missed'."""
    path = copy(source, folder)
    edit(path)
    ledger = SqliteLedger(path, clock=clock)
    try:
        seen = content(ledger)
    except StateError as exc:
        assert str(path) in exc.message and exc.fix  # names the file and says what to do
        return "detected"
    finally:
        ledger.close()
        shutil.rmtree(folder)
    return "harmless" if seen == expected else "missed"


def flip(path: Path, offset: int, mask: int) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ mask]))


def sql(path: Path, statement: str, params: tuple[Any, ...] = ()) -> None:
    """One statement by another connection, committed and closed (as a person with the sqlite3 shell)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(statement, params)
    finally:
        conn.close()


def ledger_pages(path: Path) -> list[int]:
    """Numbers (from 1) of the pages holding the ledger's tables and indexes; every page without dbstat."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT DISTINCT pageno FROM dbstat WHERE name LIKE '%ledger%' ORDER BY pageno")
        pages = [int(p) for (p,) in rows]
    except sqlite3.OperationalError:
        pages = list(range(1, path.stat().st_size // 4096 + 1))
    finally:
        conn.close()
    return pages


@pytest.fixture
def pristine(tmp_path: Path) -> tuple[Path, FakeClock, tuple[Any, ...]]:
    """A closed ledger (everything checkpointed into the main file) and what it serves."""
    clock = FakeClock()
    path = tmp_path / "ledger" / "state.sqlite3"
    ledger = build(path, clock)
    expected = content(ledger)
    ledger.close()
    assert not Path(f"{path}-wal").exists()  # the last close checkpointed and removed the WAL
    return path, clock, expected


def test_every_byte_flip_in_the_ledger_pages_is_detected_or_harmless(
    pristine: tuple[Path, FakeClock, tuple[Any, ...]], tmp_path: Path
) -> None:
    path, clock, expected = pristine
    rng = random.Random(13)
    pages = ledger_pages(path)
    data = path.read_bytes()
    json_at = [i for i in range(len(data)) if data.startswith(b'{"node-', i)]
    assert len(pages) > 10 and json_at
    offsets = [(rng.choice(pages) - 1) * 4096 + rng.randrange(4096) for _ in range(FLIPS or 150)]
    offsets += [rng.choice(json_at) + rng.randrange(30) for _ in range(FLIPS or 50)]  # inside stored JSON
    counts: Counter[str] = Counter()
    for n, offset in enumerate(offsets):
        mask = rng.randrange(1, 256)
        counts[trial(path, tmp_path / f"t{n}", clock, expected, lambda p, o=offset, m=mask: flip(p, o, m))] += 1
    print(f"\nbyte flips in the ledger pages: {dict(counts)}")
    assert counts["missed"] == 0, counts
    assert counts["detected"] > len(offsets) // 2  # most flips land on content; they are not all no-ops


@pytest.fixture
def crashed(tmp_path: Path) -> Any:
    """A crash image: the main file, a WAL with the last commits (not checkpointed) and FILE-commits."""
    clock = FakeClock()
    path = tmp_path / "live" / "state.sqlite3"
    ledger = build(path, clock, reservations=60)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    conn.close()
    for i in range(8):
        assert ledger.reserve(f"late-{i}", {"node-000/0": GIB, f"node-001/{i % 8}": GIB}, owner="late").ok
        if i % 3 == 2:
            ledger.release(f"late-{i - 1}")
    image = copy(path, tmp_path / "image")  # the live ledger is idle: a consistent crash image
    expected = content(ledger)
    yield image, clock, expected
    ledger.close()


def test_the_crash_image_opens_with_every_commit(crashed: Any, tmp_path: Path) -> None:
    image, clock, expected = crashed
    assert Path(f"{image}-wal").stat().st_size > 20 * 4096
    assert trial(image, tmp_path / "t", clock, expected, lambda p: None) == "harmless"


def test_every_byte_flip_in_the_wal_is_detected_or_harmless(crashed: Any, tmp_path: Path) -> None:
    image, clock, expected = crashed
    wal = Path(f"{image}-wal")
    size = wal.stat().st_size
    rng = random.Random(5)
    counts: dict[bool, Counter[str]] = {True: Counter(), False: Counter()}
    for n in range(FLIPS or 40):
        offset, mask = rng.randrange(size), rng.randrange(1, 256)
        for marked in (True, False):

            def edit(p: Path, o: int = offset, m: int = mask, marked: bool = marked) -> None:
                flip(Path(f"{p}-wal"), o, m)
                if not marked:
                    Path(f"{p}-commits").unlink()

            counts[marked][trial(image, tmp_path / f"t{n}{marked}", clock, expected, edit)] += 1
    print(f"\nWAL flips with FILE-commits: {dict(counts[True])}; without it: {dict(counts[False])}")
    assert counts[True]["missed"] == 0, counts
    # Without FILE-commits only a flip in the last commit frame can go unseen (a torn last write looks alike).
    assert counts[False]["missed"] <= counts[True]["detected"] // 10, counts


def test_a_damaged_wal_frame_is_named_before_sqlite_drops_the_commits_after_it(crashed: Any) -> None:
    image, _clock, _expected = crashed
    wal = Path(f"{image}-wal")
    assert wal_damage(wal, 4096) is None
    flip(wal, 32 + 3 * (24 + 4096) + 24 + 100, 0x40)  # data of frame 4
    problem = wal_damage(wal, 4096)
    assert problem is not None and "frame 4 of state.sqlite3-wal" in problem and "committed transaction" in problem
    flip(wal, 32 + 3 * (24 + 4096) + 24 + 100, 0x40)  # undo
    flip(wal, 9, 0x01)  # the header (version)
    problem = wal_damage(wal, 4096)
    assert problem is not None and "header" in problem and "SQLite would ignore the file" in problem
    Path(f"{image}-commits").unlink()  # the scan alone refuses it
    with pytest.raises(StateError, match=r"header of state\.sqlite3-wal is damaged"):
        SqliteLedger(image).accounts()


def test_a_flip_in_the_last_commit_frame_is_caught_by_the_commit_mark(crashed: Any) -> None:
    image, clock, _expected = crashed
    wal = Path(f"{image}-wal")
    frames = (wal.stat().st_size - 32) // (24 + 4096)
    flip(wal, 32 + (frames - 1) * (24 + 4096) + 24 + 50, 0x10)
    assert wal_damage(wal, 4096) is None  # alone, it looks like a torn last write
    with pytest.raises(StateError, match="lost committed changes"):
        SqliteLedger(image, clock=clock).accounts()


@pytest.mark.parametrize("cut", ["delete", "last frame", "half"])
def test_a_cut_or_deleted_wal_is_lost_commits(crashed: Any, cut: str) -> None:
    image, clock, _expected = crashed
    wal = Path(f"{image}-wal")
    if cut == "delete":
        wal.unlink()
    else:
        frames = (wal.stat().st_size - 32) // (24 + 4096)
        keep = frames - 1 if cut == "last frame" else frames // 2
        os.truncate(wal, 32 + keep * (24 + 4096))
    with pytest.raises(StateError) as caught:
        content(SqliteLedger(image, clock=clock))
    assert "lost committed changes" in caught.value.message and "state.sqlite3-commits recorded" in caught.value.message
    assert caught.value.fix and "restore the newest backup" in caught.value.fix


def test_an_older_copy_put_back_is_refused_until_its_mark_is_removed(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "state.sqlite3"
    ledger = build(path, clock, reservations=20)
    ledger.close()
    shutil.copyfile(path, tmp_path / "backup.sqlite3")
    ledger = SqliteLedger(path, clock=clock)
    assert ledger.reserve("after-backup", {"node-000/0": GIB}).ok
    ledger.close()
    shutil.copyfile(tmp_path / "backup.sqlite3", path)
    with pytest.raises(StateError, match="lost committed changes") as caught:
        SqliteLedger(path, clock=clock).accounts()
    assert caught.value.fix and f"delete {path}-commits" in caught.value.fix
    Path(f"{path}-commits").unlink()  # the operator confirms the restore
    restored = SqliteLedger(path, clock=clock)
    assert restored.get("after-backup") is None and restored.reserve("again", {"node-000/0": GIB}).ok
    restored.close()


def test_a_new_ledger_in_place_of_a_moved_one_ignores_the_old_mark(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    first = SqliteLedger(path)
    first.set_capacity({"n/0": 80 * GIB})
    assert first.reserve("a", {"n/0": GIB}).ok
    first.close()
    path.rename(tmp_path / "aside.sqlite3")  # moved aside; state.sqlite3-commits stays
    fresh = SqliteLedger(path)
    fresh.set_capacity({"n/0": 80 * GIB})
    assert fresh.reservations() == []
    fresh.close()
    assert SqliteLedger(path).accounts()["n/0"].reserved_bytes == 0


def test_rows_are_checked_when_read_after_open(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("a", {"n/0": GIB}, meta={"model": "m"}).ok
    sql(path, "UPDATE ledger_reservations SET meta_json = '{\"model\": \"x\"}' WHERE id = 'a'")
    with pytest.raises(StateError) as caught:
        ledger.reservations()
    assert caught.value.message == (
        f"the ledger file {path} is damaged: row ledger_reservations id='a' fails its checksum"
    )
    with pytest.raises(StateError, match="fails its checksum"):
        ledger.get("a")
    ledger.close()


def test_a_row_damaged_after_it_was_read_is_still_refused(tmp_path: Path) -> None:
    """``reservations()`` reuses what it decoded only for a row stored exactly as read before: damage to
    any value, or a checksum rewritten to match it, is caught; a changed row is decoded anew."""
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({"n/0": 80 * GIB, "n/1": 80 * GIB})
    assert ledger.reserve("a", {"n/0": GIB}, ttl_s=60, meta={"model": "m"}).ok
    assert ledger.reserve("b", {"n/1": GIB}, meta={"model": "m"}).ok
    first = {r.id: r for r in ledger.reservations()}
    with sqlite3.connect(path) as db:
        (meta,) = db.execute("SELECT meta_json FROM ledger_reservations WHERE id = 'a'").fetchone()
    sql(path, "UPDATE ledger_reservations SET meta_json = '{\"model\": \"x\"}' WHERE id = 'a'")
    with pytest.raises(StateError, match="row ledger_reservations id='a' fails its checksum"):
        ledger.reservations()
    sql(path, "UPDATE ledger_reservations SET meta_json = ? WHERE id = 'a'", (meta,))
    sql(path, "UPDATE ledger_reservations SET checksum = checksum + 1 WHERE id = 'b'")
    with pytest.raises(StateError, match="row ledger_reservations id='b' fails its checksum"):
        ledger.reservations()
    sql(path, "UPDATE ledger_reservations SET checksum = checksum - 1 WHERE id = 'b'")
    renewed = ledger.renew("a", 120)
    assert renewed is not None
    again = {r.id: r for r in ledger.reservations()}
    assert again["a"].expires_at == renewed.expires_at != first["a"].expires_at
    assert again["b"] == first["b"]
    ledger.close()


def test_holds_that_disagree_with_their_reservation_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({"n/0": 80 * GIB})
    assert ledger.reserve("a", {"n/0": 8 * GIB}).ok
    ledger.close()
    row = ("a", "n/0", GIB)  # a row with a valid checksum: only the cross-check sees it
    sql(path, "UPDATE ledger_holds SET bytes = ?, checksum = ?", (GIB, row_checksum("ledger_holds", row)))
    with pytest.raises(StateError, match="reservation 'a' and its rows in ledger_holds disagree"):
        SqliteLedger(path).accounts()


def test_a_missing_audit_entry_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({"n/0": 80 * GIB})
    for rid in "abc":
        assert ledger.reserve(rid, {"n/0": GIB}).ok
    ledger.close()
    sql(path, "DELETE FROM ledger_audit WHERE seq = 2")
    with pytest.raises(StateError, match=r"ledger_audit holds 2 entries for seq 1\.\.3"):
        SqliteLedger(path).accounts()


def test_a_damaged_free_page_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    ledger = SqliteLedger(path)
    ledger.set_capacity({f"n/{i}": 80 * GIB for i in range(8)})
    for i in range(300):
        assert ledger.reserve(f"r{i:03d}", {f"n/{i % 8}": 1}, owner="x" * 100).ok
    for i in range(300):
        assert ledger.release(f"r{i:03d}")
    ledger.close()
    sql(path, "DELETE FROM ledger_audit")  # frees pages; closing the last connection checkpoints them
    data = bytearray(path.read_bytes())
    trunk = int.from_bytes(data[32:36], "big")
    assert trunk > 0
    data[(trunk - 1) * 4096 + 4 : (trunk - 1) * 4096 + 8] = (10_000).to_bytes(4, "big")  # its leaf count
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="is damaged: integrity_check: "):
        SqliteLedger(path).accounts()


SCHEMA_1 = """
CREATE TABLE ledger_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE ledger_gpus (ref TEXT PRIMARY KEY, capacity INTEGER NOT NULL);
CREATE TABLE ledger_reservations (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at REAL NOT NULL,
    expires_at REAL, gpus_json TEXT NOT NULL, meta_json TEXT NOT NULL);
CREATE INDEX ledger_reservations_expiry ON ledger_reservations (expires_at);
CREATE TABLE ledger_holds (rid TEXT NOT NULL, ref TEXT NOT NULL, bytes INTEGER NOT NULL, PRIMARY KEY (rid, ref));
CREATE INDEX ledger_holds_ref ON ledger_holds (ref);
CREATE TABLE ledger_audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, action TEXT NOT NULL,
    rid TEXT NOT NULL, owner TEXT NOT NULL, gpus_json TEXT NOT NULL, expires_at REAL);
INSERT INTO ledger_meta VALUES ('schema', '1');
INSERT INTO ledger_gpus VALUES ('n/0', 85899345920), ('n/1', 85899345920);
INSERT INTO ledger_reservations VALUES ('a', 'svc', 1000.0, 4600.0, '{"n/0": 1073741824}', '{"model": "m"}');
INSERT INTO ledger_holds VALUES ('a', 'n/0', 1073741824);
INSERT INTO ledger_audit (at, action, rid, owner, gpus_json, expires_at)
    VALUES (1000.0, 'reserve', 'a', 'svc', '{"n/0": 1073741824}', 4600.0);
"""


def test_a_schema_1_ledger_gets_checksums_on_first_open(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA_1)
    old.close()
    clock = FakeClock()
    ledger = SqliteLedger(path, clock=clock)
    assert ledger.accounts()["n/0"].reserved_bytes == GIB
    held = ledger.get("a")
    assert held is not None and held.meta == {"model": "m"} and held.expires_at == 4600.0
    assert ledger.reserve("b", {"n/1": GIB}).ok and [e.seq for e in ledger.audit()] == [1, 2]
    ledger.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM ledger_meta WHERE key = 'schema'").fetchone() == ("2",)
    conn.close()
    sql(path, "UPDATE ledger_gpus SET capacity = 1 WHERE ref = 'n/1'")  # now it is caught
    with pytest.raises(StateError, match="row ledger_gpus ref='n/1' fails its checksum"):
        SqliteLedger(path, clock=clock).accounts()


def test_a_damaged_schema_1_ledger_is_refused_not_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA_1)
    old.close()
    conn = sqlite3.connect(path)
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'ledger_holds_ref'").fetchone()[0]
    conn.close()
    data = bytearray(path.read_bytes())
    data[(root - 1) * 4096 : root * 4096] = b"\0" * 4096
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="is damaged: "):
        SqliteLedger(path).accounts()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM ledger_meta WHERE key = 'schema'").fetchone() == ("1",)
    conn.close()


# ---------------------------------------------------------------------------------- permissions


def test_access_problem_names_the_folder_and_the_files_sqlite_creates(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite3"
    problem = access_problem(path, can=lambda p, mode: p != tmp_path)
    assert problem is not None
    message, fix = problem
    assert message.startswith(f"the folder {tmp_path} is not writable by user ")
    assert "state.sqlite3-wal and state.sqlite3-shm" in message and "backup" not in message + fix
    assert "TOPOSCHED_STATE" in fix
    path.write_bytes(b"")
    problem = access_problem(path, can=lambda p, mode: p != path)
    assert problem is not None and problem[0].startswith(f"the ledger file {path} is not readable and writable")
    assert access_problem(path, can=lambda p, mode: True) is None


def test_a_folder_the_user_may_not_write_is_refused_before_sqlite_opens_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "state"
    path = folder / "state.sqlite3"
    SqliteLedger(path).set_capacity({"n/0": GIB})
    # as a non-root user sees it
    monkeypatch.setattr("toposched.sqlite_file._can", lambda p, mode: p != folder)
    with pytest.raises(StateError) as caught:
        SqliteLedger(path).accounts()
    assert caught.value.message.startswith(f"the folder {folder} is not writable by user ")
    assert caught.value.fix and "backup" not in caught.value.fix


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file permissions (access_problem is unit-tested)")
@pytest.mark.parametrize("what", ["folder", "file"])
def test_a_read_only_folder_or_file_is_a_permission_error(tmp_path: Path, what: str) -> None:
    folder = tmp_path / "state"
    path = folder / "state.sqlite3"
    SqliteLedger(path).set_capacity({"n/0": GIB})
    target = folder if what == "folder" else path
    target.chmod(0o555 if what == "folder" else 0o444)
    try:
        with pytest.raises(StateError) as caught:
            SqliteLedger(path).accounts()
    finally:
        target.chmod(0o755 if what == "folder" else 0o644)
    assert "not writable" in caught.value.message or "not readable and writable" in caught.value.message
    assert caught.value.fix and "backup" not in caught.value.fix and "damaged" not in caught.value.message


def test_the_commit_mark_is_written_again_after_it_was_deleted(tmp_path: Path) -> None:
    """The mark is written through a descriptor kept open with the connection: a mark deleted (or
    replaced) while the ledger is open is written again at the next commit, not into the lost file."""
    ledger = SqliteLedger(tmp_path / "ledger.db")
    ledger.set_capacity({"n/0": 80 * GIB})
    mark = ledger.mark_path
    assert mark.exists()
    mark.unlink()
    ledger.set_capacity({"n/1": 80 * GIB})
    assert mark.read_text().startswith("toposched-ledger-commits ")
    ledger.close()

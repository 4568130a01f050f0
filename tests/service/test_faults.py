"""The service under store faults: all or none when a booking or a release fails, a background sync that
survives any exception and says so on /readyz and /metrics (issue 13, items 5 and 6).

Faults come from ``FaultyLedger``: a real ledger (memory or SQLite) behind a switchboard that makes one
method raise from its Nth call on, before the store is touched or after it (a write that committed but
whose answer was lost, as with an etcd timeout).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi import FastAPI

from toposched.errors import InputError, StateError
from toposched.ledger import open_ledger
from toposched.ledger.base import AuditEntry, Feature, GpuAccount, Ledger, Reservation, ReserveResult
from toposched.ledger.memory import MemoryLedger
from toposched.service import state as state_module
from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.service.following import STALE_PARTIAL_S
from toposched.service.schemas import PlaceBody
from toposched.service.state import ServiceState
from toposched.topology.sources import SourceRef

HGX = SourceRef(kind="preset", ref="hgx-h100")
SYNC_FAILURES = "toposched_state_sync_failures_total"


@dataclass
class Fault:
    start: int
    """Calls up to this count go through; later ones raise."""
    exc: BaseException
    commit: bool
    """Let the call reach the store first, then raise (the answer was lost, the write was not)."""


class FaultyLedger:
    """A real ledger whose methods can be made to fail (``fail``) and work again (``heal``)."""

    UNSUPPORTED: ClassVar[Mapping[Feature, str]] = {}

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.faults: dict[str, Fault] = {}

    def fail(self, method: str, exc: BaseException, *, after: int = 0, commit: bool = False) -> None:
        """``method`` raises ``exc`` once ``after`` more calls of it have gone through."""
        self.faults[method] = Fault(self.calls[method] + after, exc, commit)

    def heal(self, method: str | None = None) -> None:
        if method is None:
            self.faults.clear()
        else:
            self.faults.pop(method, None)

    def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        self.calls[method] += 1
        fault = self.faults.get(method)
        if fault is None or self.calls[method] <= fault.start:
            return getattr(self.inner, method)(*args, **kw)
        if fault.commit:
            getattr(self.inner, method)(*args, **kw)
        raise fault.exc

    def set_capacity(self, capacities: Mapping[str, int]) -> None:
        self._call("set_capacity", capacities)

    def accounts(self) -> dict[str, GpuAccount]:
        return self._call("accounts")  # type: ignore[no-any-return]

    def reserve(self, rid: str, gpus: Mapping[str, int], **kw: Any) -> ReserveResult:
        return self._call("reserve", rid, gpus, **kw)  # type: ignore[no-any-return]

    def renew(self, rid: str, ttl_s: float) -> Reservation | None:
        return self._call("renew", rid, ttl_s)  # type: ignore[no-any-return]

    def release(self, rid: str) -> bool:
        return self._call("release", rid)  # type: ignore[no-any-return]

    def get(self, rid: str) -> Reservation | None:
        return self._call("get", rid)  # type: ignore[no-any-return]

    def reservations(self) -> list[Reservation]:
        return self._call("reservations")  # type: ignore[no-any-return]

    def audit(self, *, since: int = 0, limit: int | None = None) -> list[AuditEntry]:
        return self._call("audit", since=since, limit=limit)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()


def open_state(
    monkeypatch: pytest.MonkeyPatch,
    ledger: Ledger | FaultyLedger,
    url: str = "memory",
    *,
    ledger_clock: Callable[[], float] = time.time,
    clock: Callable[[], float] = time.monotonic,
    **extra: object,
) -> ServiceState:
    """A replica whose ledger is ``ledger`` (the topology store still follows ``url``)."""
    monkeypatch.setattr(state_module, "open_ledger", lambda _url, clock: ledger)
    config = ServiceConfig.model_validate({"state": url, "source": HGX, "auth": False, **extra})
    state = ServiceState(config, clock=clock, ledger_clock=ledger_clock)
    state.open()
    return state


def body(rid: str, **fields: object) -> PlaceBody:
    return PlaceBody.model_validate({"model": "llama-3.1-8b", "id": rid, **fields})


def booked(ledger: Ledger) -> list[str]:
    return sorted(r.id for r in ledger.reservations())


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Ledger]]:
    """A ledger URL and the real ledger behind it."""
    if request.param == "memory":
        yield "memory", MemoryLedger()
        return
    url = f"sqlite:{tmp_path / 'state.sqlite3'}"
    ledger = open_ledger(url)
    yield url, ledger
    ledger.close()


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan (state and background loop) and a client on it, in this event loop."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toposched") as client:
            yield client


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 30.0) -> None:
    """Wait for the background loop (a bound against hangs only, far above the expected milliseconds)."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within_s:g} s: {what}")
        await asyncio.sleep(0.01)


async def ready_code(client: httpx.AsyncClient) -> int:
    return (await client.get("/readyz")).status_code


async def sync_failures(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(SYNC_FAILURES + " "):
            return float(line.split()[1])
    pytest.fail(f"{SYNC_FAILURES} is not in /metrics")


# ---------------------------------------------------------------------- all or none (item 5)


@pytest.mark.parametrize(
    ("exc", "commit"),
    [
        (StateError("etcd: the request timed out (test)"), False),
        (StateError("etcd: the request timed out after the write (test)"), True),
        (KeyError("gpus"), False),  # not a toposched error: a bug or a damaged answer
    ],
    ids=["state-error", "state-error-after-the-write", "key-error"],
)
def test_a_failure_on_the_second_booking_leaves_nothing_booked_and_a_retry_works(
    monkeypatch: pytest.MonkeyPatch, store: tuple[str, Ledger], exc: BaseException, commit: bool
) -> None:
    url, inner = store
    ledger = FaultyLedger(inner)
    state = open_state(monkeypatch, ledger, url)
    try:
        ledger.fail("reserve", exc, after=1, commit=commit)
        with pytest.raises(type(exc)):
            state.place(body("r", replicas=2, allowed_tp=[2]))
        assert booked(inner) == []  # replica 0 (and replica 1, when its write went through) released
        assert state.lookup("r") == [] and state.all_groups() == []
        assert state.scheduler.placements == {} and len(state.scheduler.index.free) == 8
        ledger.heal()
        again = state.place(body("r", replicas=2, allowed_tp=[2]))
        assert again.status == "placed"
        assert [i.placement.id for i in again.instances] == ["r-0", "r-1"]
        assert booked(inner) == ["r-0", "r-1"]
    finally:
        state.close()


def test_the_api_never_shows_a_partial_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = MemoryLedger()
    ledger = FaultyLedger(inner)
    state = open_state(monkeypatch, ledger, follow_interval_s=60)  # no background sync during the test
    request = {"model": "llama-3.1-8b", "id": "r", "replicas": 2, "allowed_tp": [2]}

    async def scenario() -> None:
        async with running(create_app(state.config, state)) as client:
            ledger.fail("reserve", StateError("store down (test)"), after=1)
            ledger.fail("release", StateError("store down (test)"))  # the release fails too: replica 0 stays
            answer = await client.post("/v1/placements", json=request)
            assert answer.status_code == 503, answer.text
            assert booked(inner) == ["r-0"]
            assert (await client.get("/v1/placements/r")).status_code == 404
            assert (await client.get("/v1/placements")).json() == {"placements": []}
            assert (await client.post("/v1/placements/r/renew", json={"ttl_s": 60})).status_code == 404
            ledger.heal()
            answer = await client.post("/v1/placements", json=request)
            assert answer.status_code == 201, answer.text
            assert answer.json()["replicas"] == 2
            shown = (await client.get("/v1/placements/r")).json()
            assert shown["status"] == "placed" and [i["id"] for i in shown["instances"]] == ["r-0", "r-1"]

    asyncio.run(scenario())
    assert booked(inner) == ["r-0", "r-1"]


def test_a_booking_the_store_would_not_release_goes_at_the_next_successful_sync(
    monkeypatch: pytest.MonkeyPatch, store: tuple[str, Ledger]
) -> None:
    url, inner = store
    ledger = FaultyLedger(inner)
    state = open_state(monkeypatch, ledger, url)
    try:
        ledger.fail("reserve", StateError("store down (test)"), after=1)
        ledger.fail("release", StateError("store down (test)"))
        with pytest.raises(StateError):
            state.place(body("r", replicas=2, allowed_tp=[2]))
        assert booked(inner) == ["r-0"]
        ledger.heal("reserve")
        assert not state.sync()  # the store still refuses releases: the booking stays recorded
        assert booked(inner) == ["r-0"] and state.lookup("r") == []
        ledger.heal()
        assert state.sync()
        assert booked(inner) == []
        assert len(state.scheduler.index.free) == 8
        assert state.sync() and booked(inner) == []  # nothing left to clean
    finally:
        state.close()


def test_a_retry_before_the_cleanup_completes_the_placement_and_the_cleanup_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inner = MemoryLedger()
    ledger = FaultyLedger(inner)
    state = open_state(monkeypatch, ledger)
    try:
        ledger.fail("reserve", StateError("store down (test)"), after=1)
        ledger.fail("release", StateError("store down (test)"))
        with pytest.raises(StateError):
            state.place(body("r", replicas=2, allowed_tp=[2]))
        ledger.heal()
        assert state.place(body("r", replicas=2, allowed_tp=[2])).status == "placed"
        assert state.sync()
        assert booked(inner) == ["r-0", "r-1"]
        assert [i.placement.id for i in state.lookup("r")] == ["r-0", "r-1"]
    finally:
        state.close()


def test_delete_releases_what_a_failed_request_of_another_replica_left(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = MemoryLedger()
    ledger = FaultyLedger(inner)
    failed = open_state(monkeypatch, ledger, replica="failed")
    other = open_state(monkeypatch, inner, replica="other")
    try:
        ledger.fail("reserve", StateError("store down (test)"), after=1)
        ledger.fail("release", StateError("store down (test)"))
        with pytest.raises(StateError):
            failed.place(body("r", replicas=2, allowed_tp=[2]))
        assert other.lookup("r") == []  # not a placement: GET answers 404
        assert other.release("r") == ["r-0"]  # but DELETE releases whatever the id holds
        assert booked(inner) == [] and len(other.scheduler.index.free) == 8
        assert other.release("r") is None
    finally:
        other.close()


def test_a_partial_booking_of_a_replica_that_died_is_released_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    inner = MemoryLedger(clock=lambda: now[0])
    ledger = FaultyLedger(inner)
    dead = open_state(monkeypatch, ledger, replica="dead", ledger_clock=lambda: now[0])
    alive = open_state(monkeypatch, inner, replica="alive", ledger_clock=lambda: now[0])
    try:
        assert alive.place(body("keep", replicas=2, allowed_tp=[2])).status == "placed"
        ledger.fail("reserve", StateError("store down (test)"), after=1)
        ledger.fail("release", StateError("store down (test)"))
        with pytest.raises(StateError):
            dead.place(body("r", replicas=2, allowed_tp=[2]))
        # "dead" never syncs again; "alive" hides the partial booking, then releases it once it is stale
        assert alive.sync() and booked(inner) == ["keep-0", "keep-1", "r-0"]
        assert alive.lookup("r") == [] and [len(g) for g in alive.all_groups()] == [2]
        now[0] += STALE_PARTIAL_S - 1
        assert alive.sync() and booked(inner) == ["keep-0", "keep-1", "r-0"]
        now[0] += 2
        assert alive.sync() and booked(inner) == ["keep-0", "keep-1"]  # a whole placement stays, however old
        assert len(alive.scheduler.index.free) == 4
    finally:
        alive.close()


# ---------------------------------------------------------------------- background sync (item 6)


def test_a_sync_that_raises_anything_is_logged_once_counted_and_recovers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    inner = MemoryLedger()
    ledger = FaultyLedger(inner)
    one = open_state(monkeypatch, ledger, replica="one")
    two = open_state(monkeypatch, inner, replica="two")
    try:
        ledger.fail("reservations", ValueError("row 'x': meta_json is not JSON (test)"))
        assert two.place(body("x", allowed_tp=[4])).status == "placed"  # a change "one" cannot read yet
        interval = one.config.follow_interval_s
        with caplog.at_level(logging.INFO, logger="toposched.service"):
            assert not one.sync() and not one.sync()
            assert one.last_error is not None
            assert "ValueError" in one.last_error and "meta_json is not JSON" in one.last_error
            assert one.stats().sync_failures == 2
            assert one.sync_delay() > interval  # backs off while it fails
            ledger.fail("reservations", KeyError("gpus"))
            assert not one.sync() and one.last_error is not None and "KeyError" in one.last_error
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 2  # once per distinct error, each with its traceback
            assert all(r.exc_info is not None for r in errors)
            ledger.heal()
            assert one.sync()
        assert one.last_error is None and one.stats().sync_failures == 3
        assert one.sync_delay() == interval
        assert "x" in one.instances and len(one.scheduler.index.free) == 4  # the missed change is applied
        assert any("works again" in r.getMessage() for r in caplog.records)
    finally:
        one.close()
        two.close()


def test_tick_raises_a_state_error_for_any_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tick`` is what a loop that catches ``ToposchedError`` calls: a damaged row must not escape it."""
    now = [0.0]
    ledger = FaultyLedger(MemoryLedger())
    state = open_state(monkeypatch, ledger, clock=lambda: now[0])
    try:
        ledger.fail("reservations", ValueError("damaged row (test)"))
        state.tick()  # nothing new in the audit log: the tick reads no reservation
        now[0] += state.config.resync_interval_s  # the safety net's full resync reads them all
        with pytest.raises(StateError, match="ValueError: damaged row"):
            state.tick()
        ledger.heal()
        state.tick()
        assert state.last_error is None
    finally:
        state.close()


def test_follow_keeps_its_place_until_a_resync_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = MemoryLedger()
    ledger = FaultyLedger(inner)
    one = open_state(monkeypatch, ledger, replica="one")
    two = open_state(monkeypatch, inner, replica="two")
    try:
        ledger.fail("reservations", ValueError("damaged row (test)"))
        assert two.place(body("x", allowed_tp=[4])).status == "placed"
        with pytest.raises(ValueError, match="damaged row"):
            one.follow()
        ledger.heal()
        assert one.follow() is True  # the entries it could not apply are read again
        assert "x" in one.instances and len(one.scheduler.index.free) == 4
        assert one.follow() is False
    finally:
        one.close()
        two.close()


def test_the_background_loop_survives_a_damaged_read_and_readyz_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = MemoryLedger()
    ledger = FaultyLedger(inner)
    one = open_state(monkeypatch, ledger, replica="one", follow_interval_s=0.02)
    two = open_state(monkeypatch, inner, replica="two")

    async def scenario() -> None:
        async with running(create_app(one.config, one)) as client:
            assert await ready_code(client) == 200
            ledger.fail("reservations", KeyError("gpus"))
            assert two.place(body("x", allowed_tp=[4])).status == "placed"  # "one" must read it to learn it
            await eventually(lambda: _is(ready_code(client), 503), "/readyz turns 503")
            detail = (await client.get("/readyz")).json()["detail"]
            assert "KeyError" in detail and "gpus" in detail
            first = await sync_failures(client)
            assert first >= 1
            await eventually(lambda: _at_least(sync_failures(client), first + 2), "the loop keeps trying")
            assert await ready_code(client) == 503
            ledger.heal()
            await eventually(lambda: _is(ready_code(client), 200), "/readyz back to 200")
            assert "x" in one.instances and len(one.scheduler.index.free) == 4  # the missed change is applied
            assert (await client.get("/readyz")).json() == {"status": "ready"}

    try:
        asyncio.run(scenario())
    finally:
        two.close()


def test_a_damaged_sqlite_row_fails_the_background_sync_until_it_is_repaired(tmp_path: Path) -> None:
    """A row damaged in place leaves no audit entry: the safety net's full resync finds it."""
    path = tmp_path / "state.sqlite3"
    config = ServiceConfig(
        state=f"sqlite:{path}", source=HGX, auth=False, follow_interval_s=0.02, resync_interval_s=0.05
    )
    state = ServiceState(config)
    state.open()

    def damage(meta: str) -> None:
        with sqlite3.connect(path) as db:
            db.execute("UPDATE ledger_reservations SET meta_json = ? WHERE id = 'a'", (meta,))

    async def scenario() -> None:
        async with running(create_app(config, state)) as client:
            request = {"model": "llama-3.1-8b", "id": "a", "allowed_tp": [2]}
            placed = await client.post("/v1/placements", json=request)
            assert placed.status_code == 201, placed.text
            with sqlite3.connect(path) as db:
                (meta,) = db.execute("SELECT meta_json FROM ledger_reservations WHERE id = 'a'").fetchone()
            damage(meta[:-7])
            await eventually(lambda: _is(ready_code(client), 503), "/readyz turns 503 on the damaged row")
            assert (await client.get("/readyz")).json()["detail"].startswith("background sync failed")
            assert await sync_failures(client) >= 1
            damage(meta)
            await eventually(lambda: _is(ready_code(client), 200), "/readyz back to 200 once repaired")
            assert (await client.get("/v1/placements/a")).status_code == 200

    asyncio.run(scenario())


def _sqlite_state_on_a_clock(tmp_path: Path) -> tuple[ServiceState, Path, list[float]]:
    """An open SQLite-backed state whose clock is ``now[0]`` (a full resync every 10 s of it)."""
    path = tmp_path / "state.sqlite3"
    now = [0.0]
    config = ServiceConfig(state=f"sqlite:{path}", source=HGX, auth=False, resync_interval_s=10)
    state = ServiceState(config, clock=lambda: now[0])
    state.open()
    return state, path, now


def test_a_row_damaged_in_place_is_found_by_the_next_full_resync(tmp_path: Path) -> None:
    """Damage leaves no audit entry, so a tick that only follows the log cannot see it; the full resync
    every ``resync_interval_s`` does, and every sync after it resyncs in full until the row is repaired."""
    state, path, now = _sqlite_state_on_a_clock(tmp_path)
    try:
        assert state.place(body("a", allowed_tp=[2])).status == "placed"
        with sqlite3.connect(path) as db:
            (meta,) = db.execute("SELECT meta_json FROM ledger_reservations WHERE id = 'a'").fetchone()
            db.execute("UPDATE ledger_reservations SET meta_json = ? WHERE id = 'a'", (meta[:-7],))
        now[0] += 9
        assert state.sync()  # not seen yet: the documented delay
        now[0] += 1
        assert not state.sync() and state.last_error is not None and "checksum" in state.last_error
        assert not state.sync()  # a failed sync resyncs in full again, however soon
        with sqlite3.connect(path) as db:
            db.execute("UPDATE ledger_reservations SET meta_json = ? WHERE id = 'a'", (meta,))
        assert state.sync() and state.last_error is None
    finally:
        state.close()


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def _at_least(value: Awaitable[float], bound: float) -> bool:
    return await value >= bound


def test_a_bad_request_books_nothing_and_costs_no_full_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cleaning up after a failure reads the ledger; a request refused as invalid has nothing to clean."""
    ledger = FaultyLedger(MemoryLedger())
    state = open_state(monkeypatch, ledger)
    try:
        reads = ledger.calls["reservations"]
        with pytest.raises(InputError, match="near"):
            state.place(body("b", near="nowhere", near_required=True))
        assert ledger.calls["reservations"] == reads and ledger.calls["release"] == 0
    finally:
        state.close()


def test_readyz_says_not_ready_while_writes_fail_and_ready_once_one_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: with a full disk every write answered 503 while /readyz said 200."""
    ledger = FaultyLedger(MemoryLedger())
    state = open_state(monkeypatch, ledger, follow_interval_s=0.02)

    async def scenario() -> None:
        async with running(create_app(state.config, state)) as client:
            assert await ready_code(client) == 200
            ledger.fail("reserve", StateError("database or disk is full"))
            refused = await client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "a", "allowed_tp": [2]})
            assert refused.status_code == 503
            answer = await client.get("/readyz")
            assert answer.status_code == 503
            assert answer.json()["detail"] == "the last write to the state failed: database or disk is full"
            ledger.heal()
            placed = await client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "b", "allowed_tp": [2]})
            assert placed.status_code == 201, placed.text
            assert (await client.get("/readyz")).json() == {"status": "ready"}

    asyncio.run(scenario())


def test_a_damaged_row_no_read_touches_is_found_by_the_periodic_check(tmp_path: Path) -> None:
    """Issue 37: a damaged row the service never reads again (a hold, the commit count) left it booking with
    /readyz 200 while every new process refused the file; the check of the open runs every resync_interval_s."""
    state, path, now = _sqlite_state_on_a_clock(tmp_path)
    try:
        assert state.place(body("a", allowed_tp=[2])).status == "placed"
        assert state.sync()
        with sqlite3.connect(path) as db:
            (checksum,) = db.execute("SELECT checksum FROM ledger_meta WHERE key = 'ledger_id'").fetchone()
            db.execute("UPDATE ledger_meta SET checksum = ? WHERE key = 'ledger_id'", (checksum ^ 1,))
        now[0] += 10
        assert not state.sync() and state.last_error is not None and "ledger_meta" in state.last_error
        with sqlite3.connect(path) as db:
            db.execute("UPDATE ledger_meta SET checksum = ? WHERE key = 'ledger_id'", (checksum,))
        now[0] += 10
        assert state.sync(), state.last_error
    finally:
        state.close()

"""Group commit in the service (``service/commits.py``): an answer goes out only once its change is on disk.

In process: the app's lifespan on this test's event loop, requests through httpx's ASGI transport, the
SQLite ledger in a temporary folder. The group's flush is held back (``_opened`` records instead of
scheduling it) so the test can look at the answer and the file before and after the commit.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from toposched.service.app import ServiceApp, create_app
from toposched.service.commits import GroupCommit
from toposched.service.config import ServiceConfig
from toposched.topology.sources import SourceRef

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "llama-3.1-8b", "id": "job-1"}


def on_disk(path: Path) -> list[str]:
    """The reservation ids another process reads from the ledger file."""
    with sqlite3.connect(path) as db:
        return sorted(row[0] for row in db.execute("SELECT id FROM ledger_reservations"))


def run(
    tmp_path: Path, test: Callable[[httpx.AsyncClient, ServiceApp, Path], Awaitable[None]], **config: object
) -> None:
    path = tmp_path / "state.sqlite3"
    settings = ServiceConfig(
        state=f"sqlite:{path}", source=SourceRef(kind="preset", ref="hgx-h100"), token=TOKEN, **config
    )
    app = create_app(settings)
    assert isinstance(app, ServiceApp)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH) as client:
                await test(client, app, path)

    asyncio.run(asyncio.wait_for(main(), 60))  # a held answer that is never let go fails, not hangs


def hold_flushes(commits: GroupCommit) -> list[int]:
    """Keep the group open until the test calls ``commits._flush()``; returns the list of groups opened."""
    opened: list[int] = []

    def record() -> None:
        loop = asyncio.get_running_loop()
        if commits.pending is None:
            commits.pending = loop.create_future()
        opened.append(1)

    commits._opened = record  # type: ignore[method-assign]
    commits.start()  # the ledger's hooks call the recording ``_opened``
    return opened


async def settle(task: asyncio.Task[httpx.Response]) -> None:
    for _ in range(50):  # the request runs as far as it can
        await asyncio.sleep(0)
        if task.done():
            return


def test_an_answer_waits_for_its_commit(tmp_path: Path) -> None:
    async def test(client: httpx.AsyncClient, app: ServiceApp, path: Path) -> None:
        commits = app.commits
        assert commits is not None
        opened = hold_flushes(commits)
        posting = asyncio.create_task(client.post("/v1/placements", json=BODY))
        await settle(posting)
        assert opened and not posting.done()  # booked in the open group, the answer held
        assert on_disk(path) == []
        health = asyncio.create_task(client.get("/healthz"))  # any answer waits while a group is open
        await settle(health)
        assert not health.done()
        commits._flush()
        answer = await posting
        assert (await health).status_code == 200
        assert answer.status_code == 201 and answer.json()["id"] == "job-1"
        assert on_disk(path) == ["job-1"]
        deleting = asyncio.create_task(client.delete("/v1/placements/job-1"))
        await settle(deleting)
        assert not deleting.done() and on_disk(path) == ["job-1"]
        commits._flush()
        assert (await deleting).status_code == 200 and on_disk(path) == []

    run(tmp_path, test)


def test_a_commit_that_fails_turns_its_answers_into_503_and_the_replica_forgets_them(tmp_path: Path) -> None:
    async def test(client: httpx.AsyncClient, app: ServiceApp, path: Path) -> None:
        commits = app.commits
        assert commits is not None
        hold_flushes(commits)
        state = app.state.toposched
        first = asyncio.create_task(client.post("/v1/placements", json=BODY))
        second = asyncio.create_task(client.post("/v1/placements", json={**BODY, "id": "job-2"}))
        await settle(first)
        await settle(second)
        assert not first.done() and not second.done()
        conn = commits.ledger._conn
        assert conn is not None

        def no_commit(action: int, operation: object, *_args: object) -> int:
            denied = (action, operation) == (sqlite3.SQLITE_TRANSACTION, "COMMIT")
            return sqlite3.SQLITE_DENY if denied else sqlite3.SQLITE_OK

        conn.set_authorizer(no_commit)
        commits._flush()
        conn.set_authorizer(None)
        for task in (first, second):
            answer = await task
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"] == "state unavailable" and "not authorized" in answer.json()["detail"]
        assert on_disk(path) == []
        assert (await client.get("/readyz")).status_code == 503  # until a background sync works again
        listed = await client.get("/v1/placements")  # the replica resyncs before it answers
        assert listed.status_code == 200 and listed.json()["placements"] == []
        assert state.instances.of_request("job-1") == []
        retry = asyncio.create_task(client.post("/v1/placements", json=BODY))
        await settle(retry)
        commits._flush()
        answer = await retry
        assert answer.status_code == 201 and on_disk(path) == ["job-1"]
        assert state.sync() and (await client.get("/readyz")).status_code == 200

    run(tmp_path, test)


def test_without_group_commit_each_change_is_on_disk_when_it_is_answered(tmp_path: Path) -> None:
    async def test(client: httpx.AsyncClient, app: ServiceApp, path: Path) -> None:
        assert app.commits is None
        answer = await client.post("/v1/placements", json=BODY)
        assert answer.status_code == 201 and on_disk(path) == ["job-1"]

    run(tmp_path, test, group_commit=False)


def test_groups_commit_on_their_own_under_load(tmp_path: Path) -> None:
    """The real schedule (``call_soon``): concurrent requests all answered, every change on disk, fewer
    commits than changes is not promised (it depends on timing), at most one per change is."""

    async def test(client: httpx.AsyncClient, app: ServiceApp, path: Path) -> None:
        commits = app.commits
        assert commits is not None
        ids = [f"job-{i}" for i in range(6)]
        answers = await asyncio.gather(*(client.post("/v1/placements", json={**BODY, "id": i}) for i in ids))
        assert [a.status_code for a in answers] == [201] * 6
        assert on_disk(path) == sorted(ids)
        assert 1 <= commits.groups <= 6 and commits.pending is None

    run(tmp_path, test)

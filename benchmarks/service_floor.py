"""The floor under the service's CPU per create + delete pair: what the stack costs with no scheduler in it.

    .venv/bin/python benchmarks/service_floor.py [--pairs 2000] [--repeat 3] [--gpus 256]

Issue 17 asks for at most 0.6 ms of server CPU per create + delete pair (``service_bench.py``). This prints
what the parts underneath cost on the machine it runs on, each alone, as CPU per pair (medians of
``--repeat`` runs of ``--pairs`` pairs, after a warm-up run):

* ``raw protocol``: an ``asyncio.Protocol`` with httptools' parser answering the two requests with
  fixed bytes: the sockets and the parsing, no framework (the least any Python HTTP server can cost);
* ``uvicorn, bare ASGI app``: uvicorn (httptools, as ``toposched serve`` runs it) with an ASGI app that
  reads the body and sends a fixed answer of the service's size: what uvicorn's request cycle adds;
* ``uvicorn, guarded protocol``: the same app behind ``toposched serve``'s own protocol class
  (``guards.GuardedHttpProtocol``: deadlines, header cap, connection cap);
* ``uvicorn + FastAPI``: the same answers from a FastAPI app with the service's two routes (a pydantic body
  of the fields the load sends, a path parameter; async handlers, as the service's): what the framework the
  service runs on adds to uvicorn, with no work in the handlers;
* ``ledger pair, FULL`` / ``NORMAL``: ``SqliteLedger.reserve`` + ``release`` of one GPU, in process (no
  HTTP), with ``synchronous=FULL`` (every commit fsync-ed: what the ledger runs) and ``NORMAL`` (no
  fsync at commit: what the fsyncs cost is the difference);
* ``state pair, FULL`` / ``NORMAL``: ``ServiceState.place`` + the answer's JSON + ``release`` in
  process: the scheduler, the service's records and the ledger, without HTTP;
* ``server pair``: ``toposched serve`` itself (``service_bench.py``'s measure, concurrency 8).

The HTTP rows run a server process on a free loopback port with this process as the client (httpx,
concurrency 8, keep-alive); their figure is the server process's CPU (``/proc``). The in-process rows
are this process's CPU (``time.process_time``). A floor for the server is the bare uvicorn row plus the
ledger's FULL row: requests parsed and answered by uvicorn and two fsync-ed commits, before any
decision is made (``floor``, issue 33's); the same with FastAPI in place of the bare app is the floor of the
stack the service is built on (``floor with FastAPI``). The last lines give both and the server's ratio to each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import service_bench as sb  # the benchmark next to this one: server start, load, CPU

ANSWER = b'{"id":"x","released":true}' + b" " * 600  # about the size of the service's 201 answer

SERVER = r"""
import asyncio, sys
port, mode = int(sys.argv[1]), sys.argv[2]
body = ANSWER
head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})

if mode == "raw":
    import httptools

    class Raw(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.parser = transport, httptools.HttpRequestParser(self)

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_message_complete(self):
            self.transport.write(head + body)

    async def main():
        server = await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())
else:
    import uvicorn

    if mode == "fastapi":
        from fastapi import FastAPI, Response
        from pydantic import BaseModel, ConfigDict, Field

        class Body(BaseModel):  # the shape of the service's PlaceBody's fields this load sends
            model_config = ConfigDict(extra="forbid")
            model: str = Field(min_length=1, max_length=256)
            replicas: int = Field(1, ge=1, le=1024)
            id: str | None = Field(None, max_length=253)

        app = FastAPI()

        @app.post("/v1/placements", status_code=201)
        async def create(place: Body) -> Response:
            return Response(body, media_type="application/json")

        @app.delete("/v1/placements/{pid}")
        async def delete(pid: str) -> Response:
            return Response(body, media_type="application/json")

    from toposched.service.guards import ConnectionLimits, guarded_protocol

    http = guarded_protocol(ConnectionLimits()) if mode == "guarded" else "httptools"
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http=http, ws="none")
""".replace("ANSWER", repr(ANSWER))


async def _http_pairs(url: str, pairs: int, concurrency: int) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=sb.HEADERS, limits=limits, timeout=60) as client:

        async def task(k: int) -> None:
            for i in range(k, pairs, concurrency):
                await client.post("/v1/placements", json={"model": "llama-3.1-8b", "replicas": 1, "id": f"p-{i}"})
                await client.delete(f"/v1/placements/p-{i}")

        await asyncio.gather(*(task(k) for k in range(concurrency)))


def http_row(mode: str, pairs: int, repeat: int) -> float:
    """Server CPU ms per pair of the ``mode`` server (raw, bare, guarded)."""
    port = sb.free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), mode])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        asyncio.run(_http_pairs(url, min(pairs, 200), 8))
        runs = []
        for _ in range(repeat):
            cpu = sb.process_cpu_s(proc.pid)
            asyncio.run(_http_pairs(url, pairs, 8))
            runs.append((sb.process_cpu_s(proc.pid) - cpu) / pairs * 1e3)
        return statistics.median(runs)
    finally:
        sb.stop(proc)


def _in_process(pair: Callable[[str], None], pairs: int, repeat: int) -> float:
    for i in range(min(pairs, 200)):
        pair(f"warm-{i}")
    runs = []
    for r in range(repeat):
        started = time.process_time()
        for i in range(pairs):
            pair(f"r{r}-{i}")
        runs.append((time.process_time() - started) / pairs * 1e3)
    return statistics.median(runs)


def ledger_row(sync: str, gpus: int, pairs: int, repeat: int) -> float:
    from toposched.ledger.sqlite import SqliteLedger

    with tempfile.TemporaryDirectory(prefix="toposched-floor-", dir=Path.cwd()) as tmp:
        ledger = SqliteLedger(Path(tmp) / "ledger.sqlite3")
        ledger.set_capacity({f"gpu-{n:04d}/{g}": 80 << 30 for n in range(gpus // 8) for g in range(8)})
        ledger._connect().execute(f"PRAGMA synchronous={sync}")  # this connection only

        def pair(rid: str) -> None:
            if ledger.reserve(rid, {"gpu-0000/0": 80 << 30}, owner="floor").status != "reserved":
                raise SystemExit(f"reserve {rid} refused")
            ledger.release(rid)

        try:
            return _in_process(pair, pairs, repeat)
        finally:
            ledger.close()


def state_row(sync: str, gpus: int, pairs: int, repeat: int) -> float:
    from toposched.service.api import decision_response
    from toposched.service.config import ServiceConfig
    from toposched.service.schemas import PlaceBody
    from toposched.service.state import ServiceState
    from toposched.topology.sources import SourceRef

    with tempfile.TemporaryDirectory(prefix="toposched-floor-", dir=Path.cwd()) as tmp:
        folder = Path(tmp)
        source = SourceRef(kind="cluster", ref=str(sb.cluster_spec(folder, gpus)))
        config = ServiceConfig(state=f"sqlite:{folder / 'state.sqlite3'}", source=source, auth=False)
        state = ServiceState(config)
        state.open()
        state.ledger.inner._connect().execute(f"PRAGMA synchronous={sync}")  # type: ignore[attr-defined]

        def pair(pid: str) -> None:
            decision = state.place(PlaceBody(model="llama-3.1-8b", replicas=1, id=pid))
            if decision.status != "placed":
                raise SystemExit(f"{pid}: {decision.status} {decision.reasons}")
            decision_response(state, decision)
            state.release(pid)

        try:
            return _in_process(pair, pairs, repeat)
        finally:
            state.close()
            state.worker.shutdown(wait=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=256)
    args = parser.parse_args()
    rows: list[tuple[str, Callable[[], float]]] = [
        ("raw protocol (httptools)", lambda: http_row("raw", args.pairs, args.repeat)),
        ("uvicorn, bare ASGI app", lambda: http_row("bare", args.pairs, args.repeat)),
        ("uvicorn, guarded protocol", lambda: http_row("guarded", args.pairs, args.repeat)),
        ("uvicorn + FastAPI", lambda: http_row("fastapi", args.pairs, args.repeat)),
        ("ledger pair, FULL", lambda: ledger_row("FULL", args.gpus, args.pairs, args.repeat)),
        ("ledger pair, NORMAL", lambda: ledger_row("NORMAL", args.gpus, args.pairs, args.repeat)),
        ("state pair, FULL", lambda: state_row("FULL", args.gpus, args.pairs, args.repeat)),
        ("state pair, NORMAL", lambda: state_row("NORMAL", args.gpus, args.pairs, args.repeat)),
        (
            "server pair (toposched serve)",
            lambda: sb.bench("sqlite", args.gpus, 0, [8], args.pairs, args.repeat, show=False)[0]["server_ms"],
        ),
    ]
    print(f"{'part':<32} {'ms CPU/pair':>12}")
    got: dict[str, float] = {}
    for name, measure in rows:
        got[name] = measure()
        print(f"{name:<32} {got[name]:>12.3f}", flush=True)
    server = got["server pair (toposched serve)"]
    for name, http in (("floor", "uvicorn, bare ASGI app"), ("floor with FastAPI", "uvicorn + FastAPI")):
        floor = got[http] + got["ledger pair, FULL"]
        print(f"{name:<32} {floor:>12.3f}   server / floor {server / floor:.2f}x")


if __name__ == "__main__":
    main()

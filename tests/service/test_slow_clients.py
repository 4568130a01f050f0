"""Slow and stalled clients cannot hold the service: header and body deadlines, a header size cap and a
connection cap that closes the longest-waiting connection first (issue 13 item 9), on a real server."""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.service.conftest import TOKEN, Server, StartServer

SLOW = 1100
CAP = 1000
HEADER_TIMEOUT = 4.0
BODY_TIMEOUT = 2.0
GRACE = 15.0  # generous bound against hangs on a loaded machine, on top of a deadline


@pytest.fixture(scope="module")
def guarded(serve: StartServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server started with the usual soft open-file limit of 1024 (it raises its own), and room here for
    SLOW sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SLOW + 300:
        pytest.skip(f"the open-file hard limit is {hard}; this test needs {SLOW + 300} (ulimit -Hn)")
    state = tmp_path_factory.mktemp("slow") / "state.sqlite3"
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the server starts with
    try:
        server = serve(
            "--preset", "hgx-h100", "--state", f"sqlite:{state}", "--max-connections", str(CAP),
            "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
        )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, SLOW + 300), hard))
    yield server
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection (fails the test past ``deadline``)."""
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    pytest.fail(f"the server kept the connection open; it sent {data[:200]!r}")


class SlowClients:
    """SLOW connections that each send part of a request line or headers, then one more byte now and then."""

    FIRST = (b"", b"GET /heal", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")

    def __init__(self, server: Server) -> None:
        self.selector = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        self.answers: dict[socket.socket, bytes] = {}  # what a closed one received before EOF
        for i in range(SLOW):
            sock = connect(server)
            sock.sendall(self.FIRST[i % 3])
            sock.setblocking(False)
            self.socks.append(sock)
            self.selector.register(sock, selectors.EVENT_READ)
        self.received: dict[socket.socket, bytes] = {s: b"" for s in self.socks}

    def open_count(self) -> int:
        return len(self.socks) - len(self.answers)

    def poll(self, timeout: float) -> None:
        """Collect answers and closes; every open one that has begun a request trickles one more byte."""
        for key, _ in self.selector.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                chunk = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                self.received[sock] += chunk
                continue
            self.answers[sock] = self.received[sock]
            self.selector.unregister(sock)
        for i, sock in enumerate(self.socks):
            if sock not in self.answers and i % 3:
                with contextlib.suppress(OSError):  # closed by the server: poll() sees it
                    sock.send(b"a")

    def close(self) -> None:
        self.selector.close()
        for sock in self.socks:
            sock.close()


def test_healthz_answers_while_1100_slow_connections_are_open_and_they_are_closed(guarded: Server) -> None:
    slow = SlowClients(guarded)
    try:
        started = time.monotonic()
        for _ in range(10):
            answer = httpx.get(f"{guarded.url}/healthz", timeout=5)
            assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        settled = time.monotonic() + 5
        while slow.open_count() > CAP and time.monotonic() < settled:
            slow.poll(0.05)
        assert CAP - 50 <= slow.open_count() <= CAP  # over the cap, the longest-waiting were closed, no more
        assert time.monotonic() - started < HEADER_TIMEOUT, "too slow to check the cap before the deadline"

        deadline = time.monotonic() + HEADER_TIMEOUT + GRACE
        while slow.open_count() and time.monotonic() < deadline:
            slow.poll(0.25)  # trickling a byte every 0.25 s does not extend the deadline
        assert slow.open_count() == 0, f"{slow.open_count()} slow connections still open"

        sent_nothing = [slow.answers[s] for i, s in enumerate(slow.socks) if i % 3 == 0]
        half_sent = [slow.answers[s] for i, s in enumerate(slow.socks) if i % 3]
        assert all(a == b"" for a in sent_nothing)  # nobody to answer: closed
        assert all(a == b"" or a.startswith(b"HTTP/1.1 408 ") for a in half_sent)
        timed_out = [a for a in half_sent if a]
        assert len(half_sent) - len(timed_out) <= SLOW - CAP + 50  # closed by the cap; the rest by the deadline
        assert all(b'"request timeout"' in a and b"connection: close" in a for a in timed_out)
    finally:
        slow.close()
    assert httpx.get(f"{guarded.url}/healthz", timeout=5).status_code == 200
    assert "Traceback" not in guarded.output()


def test_a_body_sent_too_slowly_gets_408(guarded: Server) -> None:
    with connect(guarded) as sock:
        head = (
            f"POST /v1/placements HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": ')
        answer = read_until_closed(sock, time.monotonic() + BODY_TIMEOUT + GRACE)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body not complete" in answer
    assert httpx.get(f"{guarded.url}/healthz", timeout=5).status_code == 200
    assert "Traceback" not in guarded.output()


def test_headers_over_the_limit_get_431(guarded: Server) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(2000):  # 64 kB of headers, never finished
                sock.sendall(b"X-Pad-%04d: %s\r\n" % (i, b"v" * 16))
        except OSError:
            pass  # closed while we were still sending
        answer = read_until_closed(sock, time.monotonic() + GRACE)
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_keep_alive_and_pipelined_requests_still_work(guarded: Server) -> None:
    with connect(guarded) as sock:
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(request * 3)  # pipelined
        time.sleep(0.2)
        sock.sendall(request)  # then once more on the same connection
        data = b""
        while data.count(b'{"status":"ok"}') < 4:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {data!r}"
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 4

"""The etcd ledger's two transports (etcd's gRPC API, its JSON gateway): the same answers and errors, a
choice that falls back to HTTP without protobuf, a gRPC client that works again in a forked child, and the
gRPC client's own HTTP/2 and HPACK against the RFC's examples and a scripted server."""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from typing import Any

import pytest

from tests.ledger.conftest import EtcdServer, grpc_missing
from toposched.errors import EtcdError, EtcdUnreachable, InputError
from toposched.ledger.etcd_client import (
    TRANSPORT_ENV,
    EtcdClient,
    Transport,
    connect,
    count_of,
    delete_op,
    kvs_of,
    mod_equals,
    put_op,
    range_op,
)


def test_both_transports_give_the_same_answers(etcd_server: EtcdServer) -> None:
    if missing := grpc_missing():
        pytest.skip(missing)
    http, grpc = connect(etcd_server.url, transport="http"), connect(etcd_server.url, transport="grpc")
    prefix = f"/same{os.getpid()}/"
    ok, _ = http.txn([], [put_op(prefix + "a", "1"), put_op(prefix + "b", b"\x00\xff")])
    assert ok
    answers = []
    for client in (http, grpc):
        ok, data = client.txn(
            [mod_equals(prefix + "a", 0)],  # fails: the failure branch runs
            [],
            [range_op(prefix, prefix=True), range_op(prefix, prefix=True, count_only=True), delete_op(prefix + "c")],
        )
        kvs = kvs_of(data["responses"][0])
        answers.append((ok, [(kv.key, kv.value) for kv in kvs], count_of(data["responses"][1]), len(data["responses"])))
        assert int(data["header"]["revision"]) >= max(kv.mod_revision for kv in kvs)
        assert client.range(prefix + "a")[0][0].value == b"1"
    assert answers[0] == answers[1] == (False, [(prefix + "a", b"1"), (prefix + "b", b"\x00\xff")], 2, 3)
    http.close()
    grpc.close()


def test_errors_keep_the_gateways_codes(etcd_server: EtcdServer, etcd_transport: Transport) -> None:
    client = connect(etcd_server.url, transport=etcd_transport)
    with pytest.raises(EtcdError) as caught:  # over etcd's --max-txn-ops (128)
        client.txn([], [put_op(f"/many/{i}", "x") for i in range(129)])
    assert caught.value.code == 3 and "too many operations" in caught.value.message
    assert f"etcd at {etcd_server.url} refused" in caught.value.message and "\n" not in caught.value.message
    with pytest.raises(EtcdError) as gone:  # a lease etcd does not know: NotFound, which the ledger relies on
        client.revoke(123456789)
    assert gone.value.code == 5 and "lease not found" in gone.value.message
    client.close()


def test_the_transport_is_chosen_by_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRANSPORT_ENV, "http")
    assert type(connect("http://127.0.0.1:1")) is EtcdClient
    monkeypatch.setenv(TRANSPORT_ENV, "carrier-pigeon")
    with pytest.raises(InputError, match="TOPOSCHED_ETCD_TRANSPORT='carrier-pigeon' is not an etcd transport"):
        connect("http://127.0.0.1:1")
    monkeypatch.delenv(TRANSPORT_ENV)
    monkeypatch.setitem(sys.modules, "toposched.ledger.etcd_grpc", None)  # as if protobuf were not installed
    assert type(connect("http://127.0.0.1:1")) is EtcdClient  # auto: the JSON gateway
    with pytest.raises(InputError, match="needs protobuf") as caught:
        connect("http://127.0.0.1:1", transport="grpc")
    assert caught.value.fix is not None and f"{TRANSPORT_ENV}=http" in caught.value.fix


def test_a_grpc_client_used_before_a_fork_works_in_the_child(etcd_server: EtcdServer) -> None:
    """Sixteen times: the parent books through a new client, forks, the child books through the same object
    (on a connection of its own: the parent's stays the parent's)."""
    if missing := grpc_missing():
        pytest.skip(missing)
    key = f"/fork{os.getpid()}"
    for attempt in range(16):
        client = connect(etcd_server.url, transport="grpc")
        assert client.txn([], [put_op(key, "parent")])[0]
        pid = os.fork()
        if pid == 0:  # the child: its own channel, the parent's left alone
            code = 1
            try:
                client.txn([], [put_op(key, f"child {attempt}")])
                code = 0 if client.range(key)[0][0].value == f"child {attempt}".encode() else 2
            except BaseException:
                traceback.print_exc()  # shows in the test's captured stderr
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"the child of attempt {attempt} failed"
        assert client.range(key)[0][0].value == f"child {attempt}".encode()  # and the parent's channel still works
        client.close()


# ------------------------------------------------------------------------------ the gRPC client's HTTP/2 and HPACK


def test_hpack_decodes_the_rfcs_examples() -> None:
    """RFC 7541 C.4.1 (a request, Huffman-coded) and C.6.1-C.6.2 (answers, Huffman-coded, with a 256-byte table:
    the second evicts the oldest entry)."""
    from toposched.ledger.etcd_grpc import _HeaderDecoder

    request = _HeaderDecoder().decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))
    assert request == {b":method": b"GET", b":scheme": b"http", b":path": b"/", b":authority": b"www.example.com"}
    decoder = _HeaderDecoder()
    decoder.max_size = 256
    first = decoder.decode(
        bytes.fromhex(
            "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad171863c78f0b97c8e9ae82ae43d3"
        )
    )
    date, location = b"Mon, 21 Oct 2013 20:13:21 GMT", b"https://www.example.com"
    assert first == {b":status": b"302", b"cache-control": b"private", b"date": date, b"location": location}
    second = decoder.decode(bytes.fromhex("4883640effc1c0bf"))
    assert second == first | {b":status": b"307"}
    assert decoder.dynamic == [
        (b":status", b"307"),
        (b"location", location),
        (b"date", date),
        (b"cache-control", b"private"),
    ]
    assert decoder.size == 222 - 42 + 42


def _read_frame(reader: Any) -> tuple[int, int, int, bytes]:
    head = reader.read(9)
    assert len(head) == 9, "the client closed the connection"
    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, reader.read(int.from_bytes(head[:3], "big"))


def _read_request(reader: Any) -> tuple[int, list[tuple[int, int, bytes]]]:
    """Frames up to a request's last DATA: (its stream, the connection's frames before it)."""
    before: list[tuple[int, int, bytes]] = []
    while True:
        kind, flags, stream, payload = _read_frame(reader)
        if kind == 0 and flags & 1:
            return stream, before
        if stream == 0:
            before.append((kind, flags, payload))


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: bytes, value: bytes, *, indexed: bool = False) -> bytes:
    """A header as an HPACK literal with a new name, added to the table when ``indexed``."""
    return (b"\x40" if indexed else b"\x00") + bytes([len(name)]) + name + bytes([len(value)]) + value


def test_the_grpc_client_follows_http2_as_a_server_may_speak_it() -> None:
    """A scripted server: SETTINGS and a PING in the middle of an answer (acknowledged with the next request),
    headers split over CONTINUATION, padded DATA, a trailer the next answer refers to by the table, a
    trailers-only error with a percent-encoded message, then GOAWAY sent right behind an answer: the next call
    goes to a new connection, whose table starts empty."""
    from toposched.ledger.etcd_grpc import EtcdGrpcClient, pb
    from toposched.ledger.etcdrpc import kv_pb2

    answer = pb.TxnResponse(
        header=pb.ResponseHeader(revision=7),
        succeeded=True,
        responses=[
            pb.ResponseOp(response_range=pb.RangeResponse(kvs=[kv_pb2.KeyValue(key=b"/k", value=b"v")], count=1))
        ],
    ).SerializeToString()
    message = len(answer).to_bytes(5, "big") + answer
    ok_headers = b"\x88" + _literal(b"content-type", b"application/grpc")  # :status 200 (static), a literal
    seen: list[list[tuple[int, int, bytes]]] = []
    listener = socket.create_server(("127.0.0.1", 0))

    failed: list[BaseException] = []

    def serve() -> None:
        try:
            script()
        except BaseException as exc:  # shown by the assertion below
            failed.append(exc)

    def script() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn, conn.makefile("rb") as reader:
                assert reader.read(24) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                stream, before = _read_request(reader)
                seen.append(before)
                trailer = _literal(b"grpc-status", b"0", indexed=True)
                conn.sendall(
                    _frame(4, 0, 0, (5).to_bytes(2, "big") + (16384).to_bytes(4, "big"))  # SETTINGS
                    + _frame(6, 0, 0, b"12345678")  # PING
                    + _frame(1, 0, stream, ok_headers[:3])  # HEADERS, without END_HEADERS
                    + _frame(9, 4, stream, ok_headers[3:])  # CONTINUATION, END_HEADERS
                    + _frame(0, 8, stream, b"\x03" + message + b"\x00" * 3)  # DATA, padded
                    + _frame(1, 5, stream, trailer)  # trailers: END_STREAM, END_HEADERS
                )
                stream, before = _read_request(reader)
                seen.append(before)
                conn.sendall(
                    _frame(1, 4, stream, ok_headers)
                    + _frame(0, 0, stream, message)
                    + _frame(1, 5, stream, b"\xbe")  # grpc-status 0: the table's entry 62
                )
                stream, before = _read_request(reader)
                error = _literal(b"grpc-status", b"9") + _literal(b"grpc-message", b"not%20now")
                conn.sendall(
                    _frame(1, 5, stream, b"\x88" + error)  # trailers-only
                    + _frame(7, 0, 0, stream.to_bytes(4, "big") + bytes(4))  # GOAWAY: nothing after this stream
                )
                assert reader.read(1) == b""  # the client closes it
            conn, _ = listener.accept()
            with conn, conn.makefile("rb") as reader:
                assert reader.read(24) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                stream, before = _read_request(reader)
                fresh = _literal(b"grpc-status", b"0")  # entry 62 would be an error on a new connection
                conn.sendall(
                    _frame(1, 4, stream, ok_headers) + _frame(0, 0, stream, message) + _frame(1, 5, stream, fresh)
                )

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    client = EtcdGrpcClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=5)
    for _ in range(2):
        ok, data = client.txn([], [range_op("/k")])
        assert ok and data["header"]["revision"] == 7 and [kv.value for kv in kvs_of(data["responses"][0])] == [b"v"]
    assert (4, 1, b"") in seen[1] and (6, 1, b"12345678") in seen[1]  # SETTINGS and PING acknowledged
    with pytest.raises(EtcdError) as refused:
        client.txn([], [range_op("/k")])
    assert refused.value.code == 9 and refused.value.message.endswith("refused txn: not now")
    ok, data = client.txn([], [range_op("/k")])  # GOAWAY came behind the error: a new connection
    assert ok and data["header"]["revision"] == 7
    client.close()
    server.join(5)
    assert not server.is_alive() and not failed


def test_an_etcd_that_takes_the_connection_but_never_answers_times_out_clearly() -> None:
    from toposched.ledger.etcd_grpc import EtcdGrpcClient

    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel accepts; nobody reads or answers
        client = EtcdGrpcClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.3)
        with pytest.raises(EtcdUnreachable, match=r"is unreachable \(TimeoutError: no answer within 0.3 s\)"):
            client.txn([], [range_op("/k")])
        client.close()


def test_a_large_answer_comes_whole(etcd_server: EtcdServer) -> None:
    """Over many frames and the windows' first 64 KiB: 4 MiB of values in one transaction's answer."""
    client = connect(etcd_server.url, transport="grpc")
    prefix = f"/large{os.getpid()}/"
    for chunk in range(4):
        assert client.txn([], [put_op(f"{prefix}{chunk}-{i:03d}", bytes([i]) * 8192) for i in range(128)])[0]
    _ok, data = client.txn([], [range_op(prefix, prefix=True)])
    kvs = kvs_of(data["responses"][0])
    assert len(kvs) == 512 and all(kv.value == bytes([int(kv.key[-3:])]) * 8192 for kv in kvs)
    client.close()


def _answer_frames(stream: int, revision: int = 7, status: bytes = b"0") -> bytes:
    """A whole successful ``TxnResponse`` answer on ``stream`` (HEADERS, DATA, trailers)."""
    from toposched.ledger.etcd_grpc import pb

    answer = pb.TxnResponse(header=pb.ResponseHeader(revision=revision), succeeded=True).SerializeToString()
    return (
        _frame(1, 4, stream, b"\x88" + _literal(b"content-type", b"application/grpc"))
        + _frame(0, 0, stream, len(answer).to_bytes(5, "big") + answer)
        + _frame(1, 5, stream, _literal(b"grpc-status", status))
    )


def _scripted(script: Any) -> tuple[str, threading.Thread, list[BaseException]]:
    """A server on a loopback port running ``script(listener)`` in a thread; (its URL, the thread, its failures)."""
    listener = socket.create_server(("127.0.0.1", 0))
    failed: list[BaseException] = []

    def serve() -> None:
        with listener:
            try:
                script(listener)
            except BaseException as exc:  # shown by the caller's assertion
                failed.append(exc)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", server, failed


def _accept(listener: socket.socket) -> tuple[socket.socket, Any]:
    conn, _ = listener.accept()
    reader = conn.makefile("rb")
    assert reader.read(24) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    return conn, reader


def test_the_grpc_client_recovers_from_what_a_server_may_do_between_and_during_calls() -> None:
    """A PING and then the end of an idle connection (etcd's keepalive closing on a client that did not
    answer): the next call takes a new connection. An answer whose grpc-status is not a number: a clear
    ``EtcdUnreachable``, and the connection is not used again. PINGs that keep coming but no answer: the
    call times out at its deadline instead of waiting for them to stop. A PRIORITY frame on the stream
    while a large request waits for window: ignored, the request goes out whole."""
    from toposched.ledger.etcd_grpc import EtcdGrpcClient

    big = b"x" * 100_000  # more than the default 65,535-byte windows

    def script(listener: socket.socket) -> None:
        conn, reader = _accept(listener)  # 1: an answer, then a PING and the end of the connection
        stream, _ = _read_request(reader)
        conn.sendall(_answer_frames(stream, revision=1))
        conn.sendall(_frame(6, 0, 0, bytes(8)))
        reader.close()
        conn.close()
        conn, reader = _accept(listener)  # 2: a new connection for the next call; then a malformed status
        stream, _ = _read_request(reader)
        conn.sendall(_answer_frames(stream, revision=2))
        stream, _ = _read_request(reader)
        conn.sendall(_frame(1, 5, stream, b"\x88" + _literal(b"grpc-status", b"x")))
        assert reader.read(1) == b""  # the client closed it
        reader.close()
        conn.close()
        conn, reader = _accept(listener)  # 3: PINGs every 0.05 s for 1 s, then the answer (too late)
        stream, _ = _read_request(reader)
        with _suppressed_os_error():  # the client gives up and closes the connection meanwhile
            for _ in range(20):
                conn.sendall(_frame(6, 0, 0, bytes(8)))
                threading.Event().wait(0.05)
            conn.sendall(_answer_frames(stream, revision=3))
        reader.close()
        conn.close()
        conn, reader = _accept(listener)  # 4: a PRIORITY frame while the request waits for window
        got, stream = 0, 0
        while True:
            kind, flags, stream, payload = _read_frame(reader)
            if kind == 0:
                got += len(payload)
                if got == 65535:
                    window = (100_000).to_bytes(4, "big")
                    priority = _frame(2, 0, stream, bytes(5))
                    conn.sendall(priority + _frame(8, 0, stream, window) + _frame(8, 0, 0, window))
                if flags & 1:
                    break
        assert got > len(big)
        conn.sendall(_answer_frames(stream, revision=4))
        assert reader.read(1) == b""
        reader.close()
        conn.close()

    url, server, failed = _scripted(script)
    client = EtcdGrpcClient(url, timeout_s=0.4)
    assert client.txn([], [range_op("/k")])[1]["header"]["revision"] == 1
    threading.Event().wait(0.3)  # the PING and the end of the connection arrive while it is idle
    assert client.txn([], [range_op("/k")])[1]["header"]["revision"] == 2
    with pytest.raises(EtcdUnreachable, match=r"malformed answer \(ValueError"):
        client.txn([], [range_op("/k")])
    with pytest.raises(EtcdUnreachable, match=r"TimeoutError: no answer within 0.4 s"):
        client.txn([], [range_op("/k")])
    assert client.txn([], [put_op("/k", big)])[1]["header"]["revision"] == 4
    client.close()
    server.join(5)
    assert not server.is_alive() and not failed, failed


class _suppressed_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


def test_the_grpc_client_over_tls_times_out_and_drops_a_closed_idle_connection(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``https://``: a server that says GOAWAY and closes behind an answer (an etcd restart) costs the next
    call nothing (a new connection); one that never answers times out (OpenSSL retries the kernel's read
    timeout, so TLS uses Python's). The certificate is made by ``openssl`` (``make system-deps``)."""
    import shutil
    import ssl
    import subprocess

    from toposched.ledger.etcd_grpc import EtcdGrpcClient

    openssl = shutil.which("openssl")
    assert openssl, "openssl is not installed (make system-deps installs it)"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client's default context trusts it
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    context.set_alpn_protocols(["h2"])

    def script(listener: socket.socket) -> None:
        for revision in (1, 2):
            raw, _ = listener.accept()
            with context.wrap_socket(raw, server_side=True) as conn, conn.makefile("rb") as reader:
                assert reader.read(24) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                stream, _ = _read_request(reader)
                conn.sendall(_answer_frames(stream, revision=revision))
                threading.Event().wait(0.1)
                conn.sendall(_frame(7, 0, 0, stream.to_bytes(4, "big") + bytes(4)))  # GOAWAY, then close
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True) as conn, conn.makefile("rb") as reader:
            assert reader.read(24) == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            _read_request(reader)
            assert reader.read(1) == b""  # never answered: the client gives up and closes

    url, server, failed = _scripted(script)
    client = EtcdGrpcClient(url.replace("http://", "https://"), timeout_s=0.5)
    assert client.txn([], [range_op("/k")])[1]["header"]["revision"] == 1
    threading.Event().wait(0.4)  # GOAWAY and the close arrive while the connection is idle
    assert client.txn([], [range_op("/k")])[1]["header"]["revision"] == 2
    threading.Event().wait(0.4)
    with pytest.raises(EtcdUnreachable, match=r"TimeoutError: no answer within 0.5 s"):
        client.txn([], [range_op("/k")])
    client.close()
    server.join(5)
    assert not server.is_alive() and not failed, failed

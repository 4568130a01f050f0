"""The etcd ledger's two transports (etcd's gRPC API through grpcio, its JSON gateway): the same answers and
errors, a choice that falls back to HTTP without grpcio or protobuf, a gRPC client that works again in a
forked child, timeouts, large answers and TLS against a real etcd."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from tests.ledger.conftest import EtcdServer, grpc_missing
from toposched.errors import EtcdError, EtcdUnreachable, InputError
from toposched.ledger.etcd_client import (
    EtcdClient,
    count_of,
    delete_op,
    kvs_of,
    mod_equals,
    put_op,
    range_op,
)
from toposched.ledger.etcd_transport import TRANSPORT_ENV, Transport, connect


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
    monkeypatch.setitem(sys.modules, "toposched.ledger.etcd_grpc", None)  # as if grpcio were not installed
    assert type(connect("http://127.0.0.1:1")) is EtcdClient  # auto: the JSON gateway
    with pytest.raises(InputError, match="needs grpcio and protobuf") as caught:
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


# ------------------------------------------------------------------------------ timeouts, size, TLS


def test_an_etcd_that_takes_the_connection_but_never_answers_times_out_clearly() -> None:
    from toposched.ledger.etcd_grpc import EtcdGrpcClient

    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel accepts; nobody reads or answers
        client = EtcdGrpcClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.3)
        with pytest.raises(EtcdUnreachable, match=r"is unreachable \(DEADLINE_EXCEEDED: "):
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


def test_the_grpc_client_speaks_tls_to_an_etcd_with_a_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``https://``: a real etcd serving TLS with a certificate made by ``openssl`` (``make system-deps``);
    the client trusts what Python's default context trusts (``SSL_CERT_FILE`` here), and refuses an etcd
    whose certificate it does not trust."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is not installed (make system-deps installs it)"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server = EtcdServer(tmp_path / "data", tls=(cert, key))
    server.start()
    try:
        from toposched.ledger.etcd_grpc import EtcdGrpcClient

        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        client = EtcdGrpcClient(server.url, timeout_s=5)
        assert server.url.startswith("https://") and client.txn([], [put_op("/tls", "yes")])[0]
        assert client.range("/tls")[0][0].value == b"yes"
        client.close()
        monkeypatch.delenv("SSL_CERT_FILE")
        stranger = EtcdGrpcClient(server.url, timeout_s=2)  # the system's CAs do not know this certificate
        with pytest.raises(EtcdUnreachable, match="is unreachable"):
            stranger.range("/tls")
        stranger.close()
    finally:
        server.stop()


def test_the_grpc_client_reaches_an_etcd_at_an_ipv6_address(tmp_path: Path) -> None:
    """``http://[::1]:PORT``: the brackets go into grpc's target too (without them grpc refuses the name)."""
    from toposched.ledger.etcd_grpc import EtcdGrpcClient

    assert EtcdGrpcClient("http://[::1]:2379")._target == "[::1]:2379"
    assert EtcdGrpcClient("https://etcd.example:2379")._target == "etcd.example:2379"
    server = EtcdServer(tmp_path / "data", host="[::1]")
    server.start()
    try:
        client = connect(server.url, transport="grpc")
        assert client.txn([], [put_op("/six", "yes")])[0] and client.range("/six")[0][0].value == b"yes"
        client.close()
    finally:
        server.stop()


def test_calls_cut_short_by_close_are_unreachable_not_refused(etcd_server: EtcdServer) -> None:
    """``close()`` from another thread while calls are running: each of them ends as ``EtcdUnreachable``
    (no answer came), never as an ``EtcdError`` (etcd refused nothing) or a raw ``ValueError``."""
    import threading

    from toposched.ledger.etcd_grpc import EtcdGrpcClient

    client = EtcdGrpcClient(etcd_server.url, timeout_s=5)
    assert client.txn([], [put_op("/closing", "x")])[0]
    odd: list[BaseException] = []
    stop = threading.Event()

    def call() -> None:
        while not stop.is_set():
            try:
                client.range("/closing")
            except EtcdUnreachable:
                pass
            except BaseException as exc:  # collected: the assertion below shows them
                odd.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    threading.Event().wait(0.2)
    for _ in range(20):
        client.close()  # the next call opens a new channel; a running one may be cut short
        threading.Event().wait(0.01)
    stop.set()
    for t in threads:
        t.join(10)
    client.close()
    assert odd == []

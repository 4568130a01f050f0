"""The etcd ledger's two transports (etcd's gRPC API, its JSON gateway): the same answers and errors, a
choice that falls back to HTTP without grpcio, and a gRPC client that works again in a forked child."""

from __future__ import annotations

import os
import sys
import traceback

import pytest

from tests.ledger.conftest import EtcdServer, grpc_missing
from toposched.errors import EtcdError, InputError
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
    monkeypatch.setitem(sys.modules, "toposched.ledger.etcd_grpc", None)  # as if grpcio were not installed
    assert type(connect("http://127.0.0.1:1")) is EtcdClient  # auto: the JSON gateway
    with pytest.raises(InputError, match="needs grpcio") as caught:
        connect("http://127.0.0.1:1", transport="grpc")
    assert caught.value.fix is not None and f"{TRANSPORT_ENV}=http" in caught.value.fix


def test_a_grpc_client_used_before_a_fork_works_in_the_child(etcd_server: EtcdServer) -> None:
    """Sixteen times: the parent books through a new client, forks, the child books through the same object.
    (With grpc's shared connections a child took over the parent's connection about one time in ten.)"""
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

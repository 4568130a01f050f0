"""etcd's errors belong to the one exception tree (``toposched.errors``) and carry a fix."""

from __future__ import annotations

import socket

import pytest

from toposched.errors import EtcdError, EtcdUnreachable, StateError
from toposched.ledger.etcd_transport import Transport, connect


def test_etcd_errors_are_state_errors() -> None:
    assert issubclass(EtcdError, StateError) and issubclass(EtcdUnreachable, StateError)


def test_an_etcd_that_does_not_answer_is_unreachable_with_the_fix(etcd_transport: Transport) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = connect(f"http://127.0.0.1:{port}", timeout_s=1.0, transport=etcd_transport)
    with pytest.raises(EtcdUnreachable, match=f"etcd at http://127.0.0.1:{port} is unreachable") as caught:
        client.range("/k")
    assert "\n" not in caught.value.message
    assert caught.value.fix is not None and "start etcd" in caught.value.fix
    client.close()


def test_an_error_answer_keeps_its_code_and_gets_the_default_fix_unless_given_one() -> None:
    error = EtcdError("etcd refused /v3/kv/txn: too many operations", code=3)
    assert error.code == 3 and error.fix is not None and "--max-txn-ops" in error.fix
    assert EtcdError("x", fix="do this").fix == "do this"

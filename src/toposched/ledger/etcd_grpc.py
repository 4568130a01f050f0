"""etcd's native gRPC API (``etcdserverpb.KV`` / ``Lease``) for the etcd ledger, with ``EtcdClient``'s calls.

The JSON gateway that ``EtcdClient`` talks to is a proxy inside etcd that turns each HTTP request into a
gRPC call; on a 2-core CI VM it was about 60 % of etcd's CPU per request (see docs/ledger.md). This client
makes the same calls directly. It takes the same operations (the dicts that ``etcd_client``'s builders
make: the gateway's field and enum names, raw keys and values) and answers in the same shape, except that
the key-values inside a transaction's ``response_range`` are already ``KeyValue``s (``kvs_of`` takes
both), so ``EtcdLedger`` does not know which transport it has. Watches are streams that are rare and
long-lived: they stay on the HTTP gateway (``EtcdClient.watch``).

gRPC is spoken here, on plain sockets: a unary call is one HTTP/2 stream (HEADERS and DATA out, HEADERS,
DATA and trailers back) on a keep-alive connection of a small pool, one connection per thread that calls
at the same time, opened lazily and again after a fork (the parent's are left alone). grpcio's channel
cost the client 0.15-0.18 ms of CPU per small call (its own threads and completion queues); these
frames, about 0.03 ms (see docs/ledger.md). What HTTP/2 asks of a client that runs one stream at a time
is all here: the connection preface and SETTINGS (server push off, windows as large as allowed so etcd
never waits for a WINDOW_UPDATE), acknowledging the server's SETTINGS and PINGs, the server's flow-control
window for requests (up to etcd's 1.5 MiB) and its frame size, CONTINUATION, padding, RST_STREAM and
GOAWAY, and HPACK (RFC 7541) to read the server's headers: the static and dynamic tables and the Huffman
code. Requests send their headers as literals, never indexed, so the server's table for them stays empty.
An idle connection is checked before reuse: frames that arrived meanwhile are handled, and one that the
server closed or is closing (GOAWAY) is dropped, so a request is never sent twice.

Errors are translated here as in ``etcd_client``: a connection that fails or times out, an answer cut
short, and the statuses UNAVAILABLE and DEADLINE_EXCEEDED are ``EtcdUnreachable``; any other status is
``EtcdError`` with the gRPC status code, which is the ``code`` the gateway reports for the same error
(5, NOT_FOUND: a lease that ran out).

The messages are generated from etcd's v3 API (``etcdrpc/``, see its README). Importing this module
needs ``protobuf`` >= 6.31.1; ``etcd_client.connect`` falls back to HTTP without it.
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

from toposched.errors import EtcdError, EtcdUnreachable
from toposched.ledger import etcd_client
from toposched.ledger.etcd_client import Json, KeyValue, WatchEvent, raw_bytes
from toposched.ledger.etcdrpc import rpc_pb2

pb: Any = rpc_pb2  # generated: its message classes are made at import time, out of mypy's sight

_BYTES = frozenset(("key", "value", "range_end"))
_OPS = {"requestRange": "request_range", "requestPut": "request_put", "requestDeleteRange": "request_delete_range"}
_OP_TYPES = {"request_range": "RangeRequest", "request_put": "PutRequest", "request_delete_range": "DeleteRangeRequest"}
_UNREACHABLE = (4, 14)  # DEADLINE_EXCEEDED, UNAVAILABLE
_STATUS_NAMES = {1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND"}
_STATUS_NAMES |= {6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION"}
_STATUS_NAMES |= {10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE"}
_STATUS_NAMES |= {15: "DATA_LOSS", 16: "UNAUTHENTICATED"}

# ------------------------------------------------------------------------------ HPACK (RFC 7541), reading

_STATIC_TEXT = (
    ":authority|:method=GET|:method=POST|:path=/|:path=/index.html|:scheme=http|:scheme=https|:status=200|"
    ":status=204|:status=206|:status=304|:status=400|:status=404|:status=500|accept-charset|"
    "accept-encoding=gzip, deflate|accept-language|accept-ranges|accept|access-control-allow-origin|age|"
    "allow|authorization|cache-control|content-disposition|content-encoding|content-language|"
    "content-length|content-location|content-range|content-type|cookie|date|etag|expect|expires|from|"
    "host|if-match|if-modified-since|if-none-match|if-range|if-unmodified-since|last-modified|link|"
    "location|max-forwards|proxy-authenticate|proxy-authorization|range|referer|refresh|retry-after|"
    "server|set-cookie|strict-transport-security|transfer-encoding|user-agent|vary|via|www-authenticate"
)
_STATIC: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode()) for name, _, value in (entry.partition("=") for entry in _STATIC_TEXT.split("|"))
)
"""Appendix A: the static table, index 1 first."""

_HUFFMAN_BITS = (
    "=GLLLLLLLHNLLNLLLLLLLLNLLLLLLLLL6::<=68;::8;8666555666666678?6<:=67777777777777777777777878=C=>6?565656665776"
    "66567655677777?;>=LDFDDFFFGFGGGGGHGHHFGHGGGGEFGFGGHFEDFFGGEGFFHEFGGEEFEGFGGDFFFGFFGJJDCFGFIJJJKKJHICEJKKJKHEE"
    "JJLKKKDHDEFEEGFFIIHHJGJKJJKKKKKLKKKKKJN"
)
"""Appendix B: the code length of each symbol 0-256 (EOS), as ``chr(48 + bits)``; the code is canonical
(codes in order of length, then symbol), so the lengths give the codes."""


def _huffman_table() -> dict[tuple[int, int], int]:
    """(bits, code) -> symbol, rebuilt from the canonical code's lengths."""
    lengths = [ord(c) - 48 for c in _HUFFMAN_BITS]
    table: dict[tuple[int, int], int] = {}
    code, previous = -1, 0
    for symbol in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        code = (code + 1) << (lengths[symbol] - previous) if code >= 0 else 0
        previous = lengths[symbol]
        table[(previous, code)] = symbol
    return table


_HUFFMAN = _huffman_table()


class _ProtocolError(OSError):
    """The server broke HTTP/2 or gRPC's rules, or the connection ended early: the answer is lost."""


def _huffman_decode(data: bytes) -> bytes:
    out = bytearray()
    code = bits = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code, bits = (code << 1) | ((byte >> shift) & 1), bits + 1
            symbol = _HUFFMAN.get((bits, code))
            if symbol is not None:
                if symbol == 256:
                    raise _ProtocolError("HPACK: EOS inside a Huffman string")
                out.append(symbol)
                code = bits = 0
            elif bits > 30:
                raise _ProtocolError("HPACK: not a Huffman code")
    if bits > 7 or code != (1 << bits) - 1:  # the padding: at most 7 bits, all ones (EOS's prefix)
        raise _ProtocolError("HPACK: bad Huffman padding")
    return bytes(out)


class _HeaderDecoder:
    """HPACK's decoding side for one connection: the dynamic table lives as long as the connection."""

    def __init__(self) -> None:
        self.dynamic: list[tuple[bytes, bytes]] = []  # newest first (index 62 is dynamic[0])
        self.size = 0
        self.max_size = 4096  # SETTINGS_HEADER_TABLE_SIZE, which this client leaves at the default
        self.seen: dict[bytes, dict[bytes, bytes]] = {}  # blocks that left the table as it was, decoded

    @staticmethod
    def _int(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
        mask = (1 << prefix) - 1
        value = block[pos] & mask
        pos += 1
        if value < mask:
            return value, pos
        shift = 0
        while True:
            if pos >= len(block) or shift > 28:
                raise _ProtocolError("HPACK: bad integer")
            byte = block[pos]
            pos += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise _ProtocolError("HPACK: a string past the end of the block")
        huffman = block[pos] & 0x80
        length, pos = self._int(block, pos, 7)
        if pos + length > len(block):
            raise _ProtocolError("HPACK: string past the end of the block")
        raw = block[pos : pos + length]
        return (_huffman_decode(raw) if huffman else raw), pos + length

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 1 <= index <= len(_STATIC):
            return _STATIC[index - 1]
        if 0 <= index - len(_STATIC) - 1 < len(self.dynamic):
            return self.dynamic[index - len(_STATIC) - 1]
        raise _ProtocolError(f"HPACK: no table entry {index}")

    def _evict(self) -> None:
        while self.size > self.max_size and self.dynamic:
            name, value = self.dynamic.pop()
            self.size -= len(name) + len(value) + 32

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        """The headers of one block. A block that leaves the table as it was (no header to be indexed, no
        size update) means the same while the table does not change: the server sends the same few blocks
        again and again, so each is decoded once per state of the table."""
        known = self.seen.get(block)
        if known is not None:
            return known
        headers, changed = self._decode(block)
        if changed:
            self.seen.clear()  # what the blocks seen so far referred to may have moved
        elif len(self.seen) < 64:
            self.seen[block] = headers
        return headers

    def _decode(self, block: bytes) -> tuple[dict[bytes, bytes], bool]:
        """The headers of one block, and whether it changed the dynamic table."""
        headers: dict[bytes, bytes] = {}
        changed = False
        pos = 0
        while pos < len(block):
            byte = block[pos]
            if byte & 0x80:  # indexed
                index, pos = self._int(block, pos, 7)
                name, value = self._entry(index)
            elif byte & 0xE0 == 0x20:  # dynamic table size update
                size, pos = self._int(block, pos, 5)
                if size > 4096:
                    raise _ProtocolError("HPACK: table size over the one allowed")
                self.max_size, changed = size, True
                self._evict()
                continue
            else:  # a literal: with incremental indexing (01), without (0000) or never indexed (0001)
                indexing = byte & 0x40
                index, pos = self._int(block, pos, 6 if indexing else 4)
                if index:
                    name = self._entry(index)[0]
                else:
                    name, pos = self._string(block, pos)
                value, pos = self._string(block, pos)
                if indexing:
                    changed = True
                    self.dynamic.insert(0, (name, value))
                    self.size += len(name) + len(value) + 32
                    self._evict()
            headers[name] = value
        return headers, changed


def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(index: int, name: bytes, value: bytes) -> bytes:
    """A header as a literal never indexed (``0001``), with the static table's name ``index`` or ``name``."""
    head = _hpack_int(index, 4, 0x10) if index else b"\x10" + _hpack_int(len(name), 7, 0) + name
    return head + _hpack_int(len(value), 7, 0) + value


# ------------------------------------------------------------------------------ HTTP/2 (RFC 9113)

_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_MAX_WINDOW = (1 << 31) - 1
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FRAME = struct.Struct(">IBI")  # length (24 bits, with the type in the low byte), flags, stream


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload) << 8 | kind).to_bytes(4, "big") + bytes([flags]) + stream.to_bytes(4, "big") + payload


_HELLO = (
    _PREFACE
    # SETTINGS: ENABLE_PUSH 0, INITIAL_WINDOW_SIZE 2^31-1; then the connection's window to 2^31-1
    + _frame(_SETTINGS, 0, 0, struct.pack(">HIHI", 2, 0, 4, _MAX_WINDOW))
    + _frame(_WINDOW_UPDATE, 0, 0, (_MAX_WINDOW - 65535).to_bytes(4, "big"))
)


class _Connection:
    """One HTTP/2 connection that runs one stream at a time."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tls = isinstance(sock, ssl.SSLSocket)
        if self.tls:
            # OpenSSL's reads retry on the EAGAIN of SO_RCVTIMEO, so that timeout never fires: Python's own
            # (a poll before every read and write) does
            sock.settimeout(timeout_s)
        else:
            # Blocking, with the kernel's timeouts: Python's own (settimeout) polls before every recv and
            # send. A recv that waited ``timeout_s`` fails with EAGAIN (BlockingIOError), an OSError too.
            sock.settimeout(None)
            whole = int(timeout_s)
            timeval = struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self.sock = sock
        self.deadline = math.inf  # the call's: a server that keeps sending cannot hold a call past it
        self.reusable = True  # False after an answer that came before the whole request was sent
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.replies = b""  # acknowledgements (SETTINGS, PING) that go out with the next request
        self.timeout_s = timeout_s
        self.buffer = bytearray()
        self.pos = 0  # where the next frame starts in ``buffer``
        self.decoder = _HeaderDecoder()
        self.next_stream = 1
        self.send_window = 65535  # the connection's, for our DATA
        self.stream_window = 0  # the open stream's
        self.initial_window = 65535  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = 16384  # the server's SETTINGS_MAX_FRAME_SIZE
        self.received = 0  # DATA bytes since this connection's window was last topped up
        self.stream_received = 0
        self.going_away = False
        self.last_stream = _MAX_WINDOW  # GOAWAY's last stream id
        sock.sendall(_HELLO)

    def close(self) -> None:
        self.sock.close()

    def _fill(self, need: int) -> None:
        """Read until ``need`` bytes past ``pos`` are in the buffer (what was read before ``pos`` is dropped
        first: the part still unread is then less than a frame, so a large answer is not copied again and again)."""
        if self.pos:
            del self.buffer[: self.pos]
            self.pos = 0
        while len(self.buffer) < need:
            if time.monotonic() > self.deadline:  # frames keep coming, the answer does not
                raise TimeoutError(f"no answer within {self.timeout_s:g} s")
            try:
                chunk = self.sock.recv(262144)
            except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO (or, on TLS, Python's timeout) ran out
                raise TimeoutError(f"no answer within {self.timeout_s:g} s") from None
            if not chunk:
                raise _ProtocolError("the connection closed in the middle of an answer")
            self.buffer += chunk

    def _next_frame(self) -> tuple[int, int, int, bytes]:
        if len(self.buffer) - self.pos < 9:
            self._fill(9)
        word, flags, stream = _FRAME.unpack_from(self.buffer, self.pos)
        size = 9 + (word >> 8)
        if len(self.buffer) - self.pos < size:
            self._fill(size)
        start = self.pos
        self.pos = start + size
        return word & 0xFF, flags, stream & _MAX_WINDOW, bytes(self.buffer[start + 9 : start + size])

    def _complete_frame(self) -> bool:
        """Whether a whole frame is in the buffer."""
        have = len(self.buffer) - self.pos
        return have >= 9 and have >= 9 + int.from_bytes(self.buffer[self.pos : self.pos + 3], "big")

    def _connection_frame(self, kind: int, flags: int, payload: bytes) -> bytes:
        """Handle a frame that is not about the open stream; what to send back (maybe nothing)."""
        if kind == _SETTINGS and not flags & _ACK:
            if len(payload) % 6:
                raise _ProtocolError("HTTP/2: a SETTINGS frame of the wrong length")
            for pos in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, pos)
                if key == 4:  # INITIAL_WINDOW_SIZE: open streams' windows move by the change
                    self.stream_window += value - self.initial_window
                    self.initial_window = value
                elif key == 5:
                    self.max_frame = value
            return _frame(_SETTINGS, _ACK, 0)
        if kind == _PING and not flags & _ACK:
            return _frame(_PING, _ACK, 0, payload)
        if kind == _GOAWAY:
            self.going_away = True
            self.last_stream = int.from_bytes(payload[:4], "big") & _MAX_WINDOW
        elif kind == _WINDOW_UPDATE:
            self.send_window += int.from_bytes(payload[:4], "big") & _MAX_WINDOW
        return b""

    def idle_check(self) -> bool:
        """Whether this idle connection can take a request: frames that came meanwhile (SETTINGS, PING)
        are handled; a connection the server closed or is closing is not usable. Everything waiting is
        read: a server that pinged an idle client and closed the connection when no answer came (etcd's
        keepalive) leaves a PING and then the end of the stream."""
        if not self.reusable:
            return False
        pending = self.tls and self.sock.pending()  # type: ignore[attr-defined]
        if (pending or self.poller.poll(0)) and not self._read_waiting():
            return False
        # frames that came after the last answer (maybe read with it): SETTINGS, PING, GOAWAY
        try:
            while self._complete_frame():
                kind, flags, stream, payload = self._next_frame()
                if stream == 0:
                    self.replies += self._connection_frame(kind, flags, payload)
        except (OSError, ValueError, IndexError, struct.error):
            return False
        return not self.going_away and self.next_stream < _MAX_WINDOW - 2

    def _read_waiting(self) -> bool:
        """Read what has arrived, without waiting; False when the server closed the connection."""
        if self.tls:
            self.sock.settimeout(0.0)  # SSLSocket.recv takes no flags
        try:
            while True:
                try:
                    chunk = self.sock.recv(262144) if self.tls else self.sock.recv(262144, socket.MSG_DONTWAIT)
                except (BlockingIOError, ssl.SSLWantReadError):
                    return True
                except (OSError, ValueError):
                    return False
                if not chunk:  # the server closed it
                    return False
                self.buffer += chunk
        finally:
            if self.tls:
                self.sock.settimeout(self.timeout_s)

    def _header_block(self, flags: int, stream: int, payload: bytes) -> dict[bytes, bytes]:
        if flags & _PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ProtocolError("HTTP/2: padding longer than its HEADERS frame")
            payload = payload[1 : len(payload) - payload[0]]
        if flags & _PRIORITY:
            payload = payload[5:]
        block = payload
        while not flags & _END_HEADERS:
            kind, flags, more, payload = self._next_frame()
            if kind != _CONTINUATION or more != stream:
                raise _ProtocolError("HTTP/2: a header block without its CONTINUATION")
            block += payload
        return self.decoder.decode(block)

    def call(self, headers: bytes, message: bytes) -> tuple[int, str, bytes]:
        """One unary call: (grpc-status, grpc-message, the answer's message). An answer that breaks the
        protocol in any way (a bad number, a header that is not text, a frame cut short) is a
        ``_ProtocolError``: the connection is then closed by the caller."""
        self.deadline = time.monotonic() + self.timeout_s
        try:
            return self._call(headers, message)
        except (ValueError, IndexError, struct.error) as exc:
            raise _ProtocolError(f"a malformed answer ({type(exc).__name__}: {exc})") from exc

    def _call(self, headers: bytes, message: bytes) -> tuple[int, str, bytes]:
        stream = self.next_stream
        self.next_stream += 2
        self.stream_window, self.stream_received = self.initial_window, 0
        body = len(message).to_bytes(5, "big") + message  # not compressed, then the length
        out = self.replies + _frame(_HEADERS, _END_HEADERS, stream, headers)
        self.replies = b""
        sent = 0
        while True:  # DATA as the server's windows allow
            while sent < len(body):
                size = min(len(body) - sent, self.max_frame, self.send_window, self.stream_window)
                if size <= 0:
                    break
                end = _END_STREAM if sent + size == len(body) else 0
                out += _frame(_DATA, end, stream, body[sent : sent + size])
                sent += size
                self.send_window -= size
                self.stream_window -= size
            if out:
                self.sock.sendall(out)
                out = b""
            if sent == len(body):
                break
            kind, flags, on, payload = self._next_frame()  # wait for a WINDOW_UPDATE
            if on == 0:
                out = self._connection_frame(kind, flags, payload)  # an acknowledgement goes out at once here
                if self.going_away and stream > self.last_stream:
                    raise _ProtocolError("etcd is going away (GOAWAY) and did not take the request")
            elif on == stream:
                if kind == _WINDOW_UPDATE:
                    self.stream_window += int.from_bytes(payload[:4], "big") & _MAX_WINDOW
                elif kind in (_HEADERS, _DATA, _RST_STREAM):
                    # the server answered before reading the whole request (an error, a reset): the
                    # stream is left half open, so the connection is not used again
                    self.reusable = False
                    return self._answer(stream, (kind, flags, payload))
                # PRIORITY and frame types this client does not know are ignored (RFC 9113, 4.1)
        return self._answer(stream, None)

    def _answer(self, stream: int, first: tuple[int, int, bytes] | None) -> tuple[int, str, bytes]:
        data = bytearray()
        while True:
            if first is not None:
                (kind, flags, payload), on, first = first, stream, None
            else:
                kind, flags, on, payload = self._next_frame()
            if on == 0:  # acknowledged with the next request (grpc-go's server pings once per request)
                self.replies += self._connection_frame(kind, flags, payload)
                if self.going_away and stream > self.last_stream:
                    raise _ProtocolError("etcd is going away (GOAWAY) and did not take the request")
                continue
            if kind == _HEADERS:
                headers = self._header_block(flags, on, payload)
                if on != stream:
                    continue
                if not flags & _END_STREAM:
                    if headers.get(b":status") != b"200":
                        raise _ProtocolError(f"HTTP status {headers.get(b':status', b'?').decode()} from a gRPC call")
                    continue
                if b"grpc-status" not in headers:
                    raise _ProtocolError(f"HTTP status {headers.get(b':status', b'?').decode()}, no gRPC status")
                status = int(headers[b"grpc-status"])
                message = self._message(data) if status == 0 else b""
                details = unquote(headers.get(b"grpc-message", b"").decode("utf-8", "replace"))
                return status, details, message
            if on != stream:
                continue
            if kind == _DATA:
                self._received(stream, len(payload))
                if flags & _PADDED:
                    if not payload or payload[0] >= len(payload):
                        raise _ProtocolError("HTTP/2: padding longer than its DATA frame")
                    payload = payload[1 : len(payload) - payload[0]]
                data += payload
                if flags & _END_STREAM:
                    raise _ProtocolError("gRPC: an answer without its status")
            elif kind == _RST_STREAM:
                raise _ProtocolError(f"HTTP/2: the stream was reset (code {int.from_bytes(payload[:4], 'big')})")
            elif kind == _WINDOW_UPDATE:
                self.stream_window += int.from_bytes(payload[:4], "big") & _MAX_WINDOW

    def _received(self, stream: int, size: int) -> None:
        """Keep both receive windows wide open (they start at 2^31-1): top them up past 1 GiB."""
        self.received += size
        self.stream_received += size
        out = b""
        if self.received > 1 << 30:
            out += _frame(_WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big"))
            self.received = 0
        if self.stream_received > 1 << 30:
            out += _frame(_WINDOW_UPDATE, 0, stream, self.stream_received.to_bytes(4, "big"))
            self.stream_received = 0
        if out:
            self.sock.sendall(out)

    @staticmethod
    def _message(data: bytearray) -> bytes:
        if len(data) < 5 or data[0] != 0 or int.from_bytes(data[1:5], "big") != len(data) - 5:
            raise _ProtocolError("gRPC: not one uncompressed message")
        return bytes(data[5:])


# ------------------------------------------------------------------------------ etcd's messages


def _fields(body: Json) -> Json:
    """An operation's or a compare's fields as its message takes them: keys, values and range ends as bytes
    (enum names pass as they are)."""
    return {name: raw_bytes(value) if name in _BYTES else value for name, value in body.items()}


def _op(op: Json) -> Any:
    """One ``{"requestPut": {...}}`` (or range, delete) as a ``RequestOp``."""
    put = op.get("requestPut")
    if put is not None:  # the most frequent, made without the general path's dicts
        value, lease = put["value"], put.get("lease", 0)
        return pb.RequestOp(request_put=pb.PutRequest(key=raw_bytes(put["key"]), value=raw_bytes(value), lease=lease))
    ((kind, body),) = op.items()
    field = _OPS[kind]
    return pb.RequestOp(**{field: getattr(pb, _OP_TYPES[field])(**_fields(body))})


_READS: dict[tuple[Any, ...], bytes] = {}  # a read's serialized RequestOp, by its fields
_READS_MAX = 4096


def _op_bytes(op: Json) -> bytes:
    """One operation as a serialized ``RequestOp``; reads, which the ledger repeats (a GPU's keys, the counts),
    are serialized once."""
    body = op.get("requestRange")
    if body is None:
        return _op(op).SerializeToString()  # type: ignore[no-any-return]
    fields = tuple(body.items())
    done = _READS.get(fields)
    if done is None:
        if len(_READS) >= _READS_MAX:
            _READS.clear()
        done = _READS[fields] = _op(op).SerializeToString()
    return done


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    """A protobuf field of wire type 2: its tag, the payload's length as a varint, the payload."""
    size, varint = len(payload), bytearray()
    while size >= 0x80:
        varint.append((size & 0x7F) | 0x80)
        size >>= 7
    varint.append(size)
    return tag + varint + payload


def _txn_request(compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json]) -> bytes:
    """A serialized ``TxnRequest`` (compare = 1, success = 2, failure = 3: each a repeated message, which in
    protobuf's wire format is the fields one after the other)."""
    parts = [_length_delimited(b"\x0a", pb.Compare(**_fields(c)).SerializeToString()) for c in compare]
    parts += [_length_delimited(b"\x12", _op_bytes(op)) for op in success]
    parts += [_length_delimited(b"\x1a", _op_bytes(op)) for op in failure]
    return b"".join(parts)


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


def _answer(resp: Any) -> Json:
    """A ``TxnResponse`` in the gateway's shape, with ``response_range`` key-values as ``KeyValue``s."""
    responses: list[Json] = []
    for one in resp.responses:
        kind = one.WhichOneof("response")
        if kind == "response_range":
            found = one.response_range
            responses.append({"response_range": {"kvs": [_kv(kv) for kv in found.kvs], "count": found.count}})
        else:
            responses.append({kind: {}})
    return {"header": {"revision": resp.header.revision}, "succeeded": resp.succeeded, "responses": responses}


_METHODS = {
    "range": ("/etcdserverpb.KV/Range", "RangeResponse"),
    "txn": ("/etcdserverpb.KV/Txn", "TxnResponse"),
    "grant": ("/etcdserverpb.Lease/LeaseGrant", "LeaseGrantResponse"),
    "revoke": ("/etcdserverpb.Lease/LeaseRevoke", "LeaseRevokeResponse"),
}


def _grpc_timeout(timeout_s: float) -> bytes:
    """gRPC's ``grpc-timeout``: at most eight digits and a unit (milliseconds, else seconds)."""
    ms = max(1, round(timeout_s * 1000))
    return f"{ms}m".encode() if ms < 10**8 else f"{min(10**8 - 1, round(timeout_s))}S".encode()


_POOL_MAX = 16
"""Idle connections kept per client; more threads than this calling at once open and close the rest."""


class EtcdGrpcClient:
    """``EtcdClient``'s calls over etcd's gRPC API, to one endpoint (``http://HOST:PORT``, the same port).
    The constructor does no I/O; it is safe to share between threads and survives a fork."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        parts = urlsplit(self.endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        authority = parts.netloc.rpartition("@")[2].encode()
        pseudo = (
            b"\x83"  # :method POST
            + (b"\x87" if self._https else b"\x86")  # :scheme
            + _literal(1, b":authority", authority)
        )
        regular = (  # after every pseudo-header
            _literal(31, b"content-type", b"application/grpc")
            + _literal(0, b"te", b"trailers")
            + _literal(0, b"grpc-timeout", _grpc_timeout(timeout_s))
        )
        self._headers = {
            name: (pseudo + _literal(4, b":path", path.encode()) + regular, getattr(pb, response).FromString)
            for name, (path, response) in _METHODS.items()
        }
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._pid = os.getpid()
        self._http = etcd_client.EtcdClient(endpoint, timeout_s=timeout_s)  # for watches

    def _mine(self) -> None:
        """In a forked child: forget the parent's connections (not ours to use or close) and its lock
        (another thread of the parent may have held it at the fork)."""
        if self._pid != os.getpid():
            self._lock, self._idle, self._pid = threading.Lock(), [], os.getpid()

    def _take(self) -> _Connection:
        """An idle connection that can take a request, else a new one."""
        self._mine()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if conn.idle_check():
                return conn
            conn.close()
        sock = socket.create_connection((self._host, self._port), timeout=self.timeout_s)
        if self._https:
            context = ssl.create_default_context()
            context.set_alpn_protocols(["h2"])
            sock = context.wrap_socket(sock, server_hostname=self._host)
        return _Connection(sock, self.timeout_s)

    def _call(self, name: str, request: bytes) -> Any:
        """Call ``name`` with a serialized request; the answer, parsed."""
        headers, parse = self._headers[name]
        conn: _Connection | None = None
        try:
            conn = self._take()
            status, details, raw = conn.call(headers, request)
        except OSError as exc:  # refused, reset, timed out, or an answer cut short or malformed (_ProtocolError)
            if conn is not None:
                conn.close()
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, BlockingIOError):  # SO_SNDTIMEO ran out
                reason = f"TimeoutError: the request not taken within {self.timeout_s:g} s"
            raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({reason})") from exc
        except BaseException:  # interrupted (KeyboardInterrupt ...): the stream's state is unknown
            if conn is not None:
                conn.close()
            raise
        keep = False
        with self._lock:
            if self._pid == os.getpid() and conn.reusable and len(self._idle) < _POOL_MAX:
                self._idle.append(conn)
                keep = True
        if not keep:
            conn.close()
        if status in _UNREACHABLE:
            raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({_STATUS_NAMES[status]}: {details})")
        if status:
            raise EtcdError(f"etcd at {self.endpoint} refused {name}: {details}", code=status)
        try:
            return parse(raw)
        except DecodeError as exc:
            reason = f"an answer to {name} that is not etcd's: {exc}"
            raise EtcdUnreachable(f"etcd at {self.endpoint} is unreachable ({reason})") from exc

    def range(
        self, key: str, *, prefix: bool = False, sort_by_create: bool = False, min_create_revision: int = 0
    ) -> tuple[list[KeyValue], int]:
        """Key-values at ``key`` (or under the prefix) and the store's revision."""
        body = etcd_client.range_req(
            key, prefix=prefix, sort_by_create=sort_by_create, min_create_revision=min_create_revision
        )
        resp = self._call("range", pb.RangeRequest(**_fields(body)).SerializeToString())
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    def txn(self, compare: Sequence[Json], success: Sequence[Json], failure: Sequence[Json] = ()) -> tuple[bool, Json]:
        """Run a transaction; (whether the compares held, the answer)."""
        resp = self._call("txn", _txn_request(compare, success, failure))
        return bool(resp.succeeded), _answer(resp)

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        resp = self._call("grant", pb.LeaseGrantRequest(TTL=ttl_s).SerializeToString())
        return int(resp.ID), int(resp.TTL)

    def revoke(self, lease: int) -> None:
        """End a lease now, and delete the keys attached to it."""
        self._call("revoke", pb.LeaseRevokeRequest(ID=lease).SerializeToString())

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> Iterator[WatchEvent]:
        """As ``EtcdClient.watch`` (over the JSON gateway: a watch is one long stream, not a hot path)."""
        return self._http.watch(key, prefix=prefix, start_revision=start_revision)

    def close(self) -> None:
        """Close this process's idle connections and end the watches in progress."""
        with self._lock:
            idle, mine = self._idle, self._pid == os.getpid()
            self._idle = []
        if mine:
            for conn in idle:
                conn.close()
        self._http.close()

"""A shard's queries over a TCP connection of their own, beside Ray.

A queried replica's misses wait for their answer (lookups answer RETRY meanwhile), so a
query is the one Directory call whose latency a request feels. Through Ray it is an actor
call: a submission thread and gRPC on the replica's side, gRPC and task execution on the
shard's, each a thread to wake, and a few hundred microseconds of CPU on each side
(docs/scale.md). Over the channel it is one frame written by the link's thread, read and
answered on the shard's event loop between its other calls, and read back by the
channel's reader thread. Every other call stays on Ray, and a query goes through Ray
while its channel is not connected (`ray_actors.directory.ShardActorClient`).

Only a caller Ray let in can connect: the shard hands its endpoint and a random token
out through its Ray actor method (`query_endpoint`), and a connection that does not open
with that token is closed unanswered. A connection is bound to one cache namespace, which
its hello names and the server checks once. The server never unpickles: requests are
length-prefixed keys; answers are the shard's packed answers. The channel is plaintext, as
Ray's own traffic is by default; where Ray's is encrypted (`RAY_USE_TLS`), shards serve no
channel and queries stay on Ray (`channel_allowed`).

Frames, little-endian, each a u32 length and then its body:
- hello (client): the token, then the namespace in UTF-8;
- welcome (server): u8 status (0: accepted; 1: refused, the UTF-8 reason follows);
- request (client): u32 id, then per key a u16 length and its bytes;
- answer (server): u32 id, u8 status (0: the packed answer follows; 1: a UTF-8 error).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from distkv.abstract import OffloadKey

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
# a request carries at most a Querier's batch (4,096 keys of ~40 bytes); an answer names
# each key's holders and their replicas' infos
MAX_REQUEST_BYTES = 1 << 20
MAX_ANSWER_BYTES = 1 << 26
CONNECT_TIMEOUT_S = 5.0
# a channel whose oldest request has waited this long is closed, its requests failed: a
# shard whose node vanished without closing the connection answers nothing
STALE_ANSWER_S = 2.0
# after a lost or failed connection, queries wait this long before the next try (going
# through Ray meanwhile), twice as long after each failure in a row up to the most: a
# channel a firewall blocks costs its shard an endpoint call a minute, not a second
RECONNECT_DELAY_S = 1.0
MAX_RECONNECT_DELAY_S = 60.0

_LENGTH = struct.Struct("<I")
_ID = struct.Struct("<I")
_ANSWER_HEAD = struct.Struct("<IB")
_KEY_LENGTH = struct.Struct("<H")
OK, ERROR = 0, 1


def channel_allowed() -> bool:
    """Whether queries may leave Ray for a channel: not where Ray encrypts its own traffic
    (`RAY_USE_TLS`, read as Ray reads it), which a plaintext channel would undercut."""
    return os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true")


class ProtocolError(ConnectionError):
    """The peer sent a frame this protocol does not allow; the connection is closed."""


class RefusedError(ConnectionError):
    """The server refused the connection's hello (namespace); the reason is the message."""


def encode_keys(request_id: int, keys: Sequence[OffloadKey]) -> bytes:
    """A request frame, length included."""
    parts = [b"", _ID.pack(request_id)]
    for key in keys:
        if len(key) > 0xFFFF:
            raise ValueError(f"a key of {len(key)} bytes: keys are at most 65,535 bytes")
        parts.append(_KEY_LENGTH.pack(len(key)))
        parts.append(key)
    body_bytes = sum(len(p) for p in parts)
    if body_bytes > MAX_REQUEST_BYTES:
        raise ValueError(f"a query of {len(keys)} keys is {body_bytes} bytes, over {MAX_REQUEST_BYTES}")
    parts[0] = _LENGTH.pack(body_bytes)
    return b"".join(parts)


def decode_keys(body: bytes) -> tuple[int, list[OffloadKey]]:
    """A request's id and keys, from its body; ProtocolError if it is not one."""
    if len(body) < _ID.size:
        raise ProtocolError(f"a request of {len(body)} bytes has no id")
    (request_id,) = _ID.unpack_from(body)
    keys: list[OffloadKey] = []
    at, end = _ID.size, len(body)
    while at < end:
        if at + _KEY_LENGTH.size > end:
            raise ProtocolError("a request ends inside a key's length")
        (length,) = _KEY_LENGTH.unpack_from(body, at)
        at += _KEY_LENGTH.size
        if at + length > end:
            raise ProtocolError("a request ends inside a key")
        keys.append(OffloadKey(body[at : at + length]))
        at += length
    return request_id, keys


def _frame(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body


class QueryServer:
    """Serves one shard's queries on the shard's event loop.

    `answer(keys)` is the shard's packed answer; it runs on the loop, between the shard's
    other calls, one request after another per connection. An exception it raises goes
    back as that request's error; a connection that breaks the protocol, or does not open
    with `token`, is closed.
    """

    def __init__(
        self, answer: Callable[[list[OffloadKey]], bytes], namespace: str, token: bytes,
        check_namespace: Callable[[str], None],
    ) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a token of {len(token)} bytes: must be {TOKEN_BYTES}")
        self._answer = answer
        self._namespace = namespace
        self._token = token
        self._check_namespace = check_namespace
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # of the connections open now

    async def start(self, host: str) -> tuple[str, int]:
        """Listen on `host`, on a port the system picks; (host, port)."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        return host, self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop listening and drop every connection, answering nothing more (on the loop)."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._writers.add(writer)
        try:
            hello = await _read_frame(reader, TOKEN_BYTES + 4096)
            if not hmac.compare_digest(hello[:TOKEN_BYTES], self._token):
                logger.warning("query channel: %s opened with a wrong token; closed", peer)
                return
            try:
                self._check_namespace(hello[TOKEN_BYTES:].decode())
            except (ValueError, UnicodeDecodeError) as e:
                writer.write(_frame(bytes([ERROR]) + str(e).encode()))
                return
            writer.write(_frame(bytes([OK])))
            while True:
                request_id, keys = decode_keys(await _read_frame(reader, MAX_REQUEST_BYTES))
                try:
                    status, payload = OK, self._answer(keys)
                except Exception as e:
                    status, payload = ERROR, f"{type(e).__name__}: {e}".encode()
                writer.write(_LENGTH.pack(_ANSWER_HEAD.size + len(payload)) + _ANSWER_HEAD.pack(request_id, status))
                writer.write(payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if isinstance(e, ProtocolError):
                logger.warning("query channel: %s: %s; closed", peer, e)
        finally:
            self._writers.discard(writer)
            writer.close()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > limit:
        raise ProtocolError(f"a frame of {length} bytes, over {limit}")
    return await reader.readexactly(length)


class QueryChannel:
    """One process's connection to one shard's `QueryServer`, for queries of `namespace`.

    `query(keys)` writes its request and returns the Future of the packed answer, which
    the channel's reader thread sets; it raises ConnectionError at once when the channel
    is not connected (`connected`), so that the caller sends the query another way.
    `connect()` starts connecting in the background: `endpoint()` is the Future of the
    shard's (host, port, token) (its Ray method), then the hello. A lost connection fails
    every request in flight with ConnectionError; the next `connect()` tries again after
    RECONNECT_DELAY_S, doubled after each failed try in a row up to MAX_RECONNECT_DELAY_S.
    Thread-safe.
    """

    def __init__(
        self, endpoint: Callable[[], Future], namespace: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._endpoint = endpoint
        self._hello_namespace = namespace.encode()
        self._clock = clock
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None  # set once the server welcomed this channel
        self._pending: dict[int, tuple[Future, float]] = {}  # in sending order
        self._next_id = 0
        self._connecting = False
        self._retry_at = 0.0
        self._failed_tries = 0  # connection attempts failed since the last that succeeded
        self._closed = False
        self.last_error: Exception | None = None

    @property
    def connected(self) -> bool:
        return self._socket is not None

    @property
    def connecting(self) -> bool:
        """Whether a `connect()` is under way; once it ends, `connected` or `last_error` says how."""
        return self._connecting

    def connect(self) -> None:
        """Start connecting, unless connected, connecting, or waiting to try again."""
        with self._lock:
            if self._closed or self._socket is not None or self._connecting or self._clock() < self._retry_at:
                return
            self._connecting = True
        threading.Thread(target=self._run, name="distkv-query-channel", daemon=True).start()

    def query(self, keys: Sequence[OffloadKey]) -> Future:
        future: Future = Future()
        frame_error: Exception | None = None
        with self._lock:
            sock = self._socket
            if sock is None:
                raise ConnectionError("query channel not connected")
            if self._pending and self._clock() - next(iter(self._pending.values()))[1] > STALE_ANSWER_S:
                frame_error = ConnectionError(f"query channel closed: no answer within {STALE_ANSWER_S} s")
            else:
                request_id = self._next_id
                self._next_id = (request_id + 1) & 0xFFFFFFFF
                frame = encode_keys(request_id, keys)
                try:
                    # the link's thread never waits on the network: a request the socket's
                    # buffer cannot take at once means a shard that stopped reading
                    sent = sock.send(frame, socket.MSG_DONTWAIT)
                except OSError as e:
                    sent, frame_error = 0, ConnectionError(f"query channel closed: sending failed: {e}")
                if sent == len(frame):
                    # sent and recorded under the lock, under which the reader takes an
                    # answer's Future: an answer that comes back at once still finds it
                    self._pending[request_id] = (future, self._clock())
                    return future
                # a frame sent in part leaves the stream unreadable: the connection goes
                frame_error = frame_error or ConnectionError("query channel closed: the socket took part of a request")
            failed = self._detach(sock, frame_error)
        _fail(failed, frame_error)
        raise frame_error

    def close(self) -> None:
        error = ConnectionError("query channel closed")
        with self._lock:
            self._closed = True
            failed = self._detach(self._socket, error)
        _fail(failed, error)

    def _detach(self, sock: socket.socket | None, error: Exception) -> list[Future]:
        """Under `_lock`: if `sock` is the connection, forget it (its reader thread ends on
        it); the Futures in flight on it, for the caller to fail once it has let go of the lock
        (their callbacks may query again)."""
        if sock is None or self._socket is not sock:
            return []
        self._socket = None
        self.last_error = error
        self._retry_at = self._clock() + RECONNECT_DELAY_S
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        pending, self._pending = self._pending, {}
        return [future for future, _ in pending.values()]

    def _run(self) -> None:
        sock: socket.socket | None = None
        try:
            host, port, token = self._endpoint().result(timeout=CONNECT_TIMEOUT_S)
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.sendall(_frame(token + self._hello_namespace))
            welcome = _recv_frame(sock, 4096)
            if welcome[:1] != bytes([OK]):
                raise RefusedError(welcome[1:].decode(errors="replace"))
            sock.settimeout(None)
        except Exception as e:
            if sock is not None:
                sock.close()
            with self._lock:
                self._connecting = False
                self.last_error = e
                self._failed_tries += 1
                delay = min(MAX_RECONNECT_DELAY_S, RECONNECT_DELAY_S * 2 ** (self._failed_tries - 1))
                self._retry_at = self._clock() + delay
            logger.debug("query channel: connecting failed (%d in a row): %s", self._failed_tries, e)
            return
        with self._lock:
            self._connecting = False
            if self._closed:
                sock.close()
                return
            self._socket = sock
            self._failed_tries = 0
        self._read(sock)

    def _read(self, sock: socket.socket) -> None:
        """The reader thread: set each answer's Future until the connection ends."""
        try:
            while True:
                body = _recv_frame(sock, MAX_ANSWER_BYTES)
                if len(body) < _ANSWER_HEAD.size:
                    raise ProtocolError(f"an answer of {len(body)} bytes has no head")
                request_id, status = _ANSWER_HEAD.unpack_from(body)
                with self._lock:
                    if self._socket is not sock:  # dropped meanwhile, its requests failed
                        break
                    entry = self._pending.pop(request_id, None)
                if entry is None:
                    raise ProtocolError(f"an answer to request {request_id}, which is not in flight")
                payload = body[_ANSWER_HEAD.size :]
                if status == OK:
                    entry[0].set_result(payload)
                else:
                    entry[0].set_exception(RuntimeError(f"shard: {payload.decode(errors='replace')}"))
        except OSError as e:
            error = e if isinstance(e, ConnectionError) else ConnectionError(f"query channel lost: {e}")
            with self._lock:
                failed = self._detach(sock, error)
            _fail(failed, error)
        sock.close()


def _fail(futures: list[Future], error: Exception) -> None:
    for future in futures:
        future.set_exception(error)


def _recv_frame(sock: socket.socket, limit: int) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > limit:
        raise ProtocolError(f"a frame of {length} bytes, over {limit}")
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("query channel: the shard closed the connection")
        data += chunk
    return bytes(data)

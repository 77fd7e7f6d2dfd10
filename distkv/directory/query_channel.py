"""A shard's queries over a TCP connection of their own, beside Ray.

A queried replica's misses wait for their answer (lookups answer RETRY meanwhile), so a
query is the one Directory call whose latency a request feels. Through Ray it is an actor
call: a submission thread and gRPC on the replica's side, gRPC and task execution on the
shard's, each a thread to wake, and a few hundred microseconds of CPU on each side
(docs/scale.md). Over the channel it is one frame written by the link's thread, read and
answered on the shard's event loop between its other calls, and read back by the
channel's reader thread. Every other call stays on Ray, and a query goes through Ray
while its channel is not connected (`ray_actors.directory.ShardActorClient`). A channel
gRPC would give costs several times as much a query (docs/benchmarks.md), so the framing
and the handshake are this module's own.

Both ends prove they hold the shard's token, which the shard hands out through its Ray
actor method (`query_endpoint`), so that only a caller Ray let in gets an answer and the
replica talks only to the shard Ray named: a challenge each way (keyed BLAKE2b of both
nonces), the token never sent. Every frame after that carries a tag under a key of that
connection (keyed BLAKE2b of the frame and its number in its direction): a frame altered,
replayed, dropped or injected on the way closes the connection. A connection is bound to
one cache namespace, which its hello names and the server checks once. Nothing is
unpickled either way: requests are length-prefixed keys, answers the shard's typed answers
(`distkv.directory.wire`). The channel is not encrypted, as Ray's own traffic is not by
default; where Ray's is (`RAY_USE_TLS`), shards serve no channel and queries stay on Ray
(`channel_allowed`).

A shard spends on its connections only what it chooses to: a connection that has not
proved itself within HELLO_TIMEOUT_S is closed, at most MAX_HANDSHAKES connections prove
themselves at once (one more is closed at once) and MAX_CONNECTIONS serve (one more is
refused, with the reason), a request carries MAX_CALL_KEYS keys at most, and each
connection is answered KEYS_PER_S keys a second on average, KEY_BURST at once: a request
over its connection's budget waits, read but unanswered, and nothing more is read from that
connection meanwhile, so that its sender's socket fills (its channel then closes, and its
queries go through Ray until it connects again).

Frames, little-endian, each a u32 length and then its body; a tag ends the body of every
frame after the proofs:
- hello (client): a 32-byte nonce, then the namespace in UTF-8;
- challenge (server): its 32-byte nonce, then its 32-byte proof;
- proof (client): its 32-byte proof;
- welcome (server): u8 status (0: accepted; 1: refused, the UTF-8 reason follows);
- request (client): u32 id, then per key a u16 length and its bytes;
- answer (server): u32 id, u8 status (0: the encoded answer follows; 1: a UTF-8 error).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from distkv.abstract import OffloadKey
from distkv.directory.wire import MAX_ANSWER_BYTES, MAX_CALL_KEYS
from distkv.storage.slots import MAX_KEY_BYTES

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32
TAG_BYTES = 16
MAX_NAMESPACE_BYTES = 1024
MAX_REASON_BYTES = 4096
CONNECT_TIMEOUT_S = 5.0
# a channel whose oldest request has waited this long is closed, its requests failed: a
# shard whose node vanished without closing the connection answers nothing
STALE_ANSWER_S = 2.0
# after a lost or failed connection, queries wait this long before the next try (going
# through Ray meanwhile), twice as long after each failure in a row up to the most: a
# channel a firewall blocks costs its shard an endpoint call a minute, not a second
RECONNECT_DELAY_S = 1.0
MAX_RECONNECT_DELAY_S = 60.0
# What a shard's server gives its connections (the module's docstring). A replica process
# keeps one connection to each shard, and a replica's queries ask about its requests'
# misses, a few thousand keys a second at full load (docs/scale.md).
HELLO_TIMEOUT_S = 2.0
MAX_HANDSHAKES = 64
MAX_CONNECTIONS = 4096
KEYS_PER_S = 1 << 14
KEY_BURST = 2 * MAX_CALL_KEYS

_LENGTH = struct.Struct("<I")
_ID = struct.Struct("<I")
_ANSWER_HEAD = struct.Struct("<IB")
_KEY_LENGTH = struct.Struct("<H")
MAX_REQUEST_BYTES = _ID.size + MAX_CALL_KEYS * (_KEY_LENGTH.size + MAX_KEY_BYTES)
OK, ERROR = 0, 1
# what each proof and each direction's tags are of, so that none stands for another
_SERVER_PROOF, _CLIENT_PROOF, _SESSION = b"distkv query server proof", b"distkv query client proof", b"distkv query session"
_TO_SERVER, _TO_CLIENT = b"distkv query c2s", b"distkv query s2c"


def channel_allowed() -> bool:
    """Whether queries may leave Ray for a channel: not where Ray encrypts its own traffic
    (`RAY_USE_TLS`, read as Ray reads it), which an unencrypted channel would undercut."""
    return os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true")


class ProtocolError(ConnectionError):
    """The peer sent a frame this protocol does not allow; the connection is closed."""


class UnprovenError(ConnectionError):
    """The peer did not prove it holds the shard's token; the connection is closed."""


class RefusedError(ConnectionError):
    """The server refused the connection (its namespace, or no room); the reason is the message."""


def encode_keys(request_id: int, keys: Sequence[OffloadKey]) -> bytes:
    """A request's body: its id and keys."""
    if len(keys) > MAX_CALL_KEYS:
        raise ValueError(f"a query of {len(keys)} keys: a query asks about {MAX_CALL_KEYS} at most")
    parts = [_ID.pack(request_id)]
    for key in keys:
        if len(key) > 0xFFFF:
            raise ValueError(f"a key of {len(key)} bytes: keys are at most 65,535 bytes")
        parts.append(_KEY_LENGTH.pack(len(key)))
        parts.append(key)
    body = b"".join(parts)
    if len(body) > MAX_REQUEST_BYTES:
        raise ValueError(f"a query of {len(keys)} keys is {len(body)} bytes, over {MAX_REQUEST_BYTES}")
    return body


def decode_keys(body: bytes) -> tuple[int, list[OffloadKey]]:
    """A request's id and keys, from its body; ProtocolError if it is not one."""
    if len(body) < _ID.size:
        raise ProtocolError(f"a request of {len(body)} bytes has no id")
    (request_id,) = _ID.unpack_from(body)
    keys: list[OffloadKey] = []
    at, end = _ID.size, len(body)
    while at < end:
        if len(keys) == MAX_CALL_KEYS:
            raise ProtocolError(f"a request of more than {MAX_CALL_KEYS} keys")
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


def _proof(token: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, namespace: bytes) -> bytes:
    """What only a holder of `token` can answer to both nonces, as `role`, for `namespace`."""
    return hashlib.blake2b(role + client_nonce + server_nonce + namespace, key=token, digest_size=PROOF_BYTES).digest()


class Session:
    """The tags of one proven connection's frames: a key of its own (from the token and
    both nonces) and a count of the frames each way, so that a frame is accepted once, in
    its place, from the end that proved itself. Sealing and opening each take one thread
    at a time (a channel seals under its lock and opens on its reader thread)."""

    def __init__(self, token: bytes, client_nonce: bytes, server_nonce: bytes, namespace: bytes, *, client: bool) -> None:
        self._key = hashlib.blake2b(_SESSION + client_nonce + server_nonce + namespace, key=token).digest()
        self._sends, self._receives = (_TO_SERVER, _TO_CLIENT) if client else (_TO_CLIENT, _TO_SERVER)
        self._sent = 0
        self._received = 0

    def frame(self, *parts: bytes) -> bytes:
        """A frame of `parts`, length and tag included."""
        tag = self._tag(self._sends, self._sent, parts)
        self._sent += 1
        return b"".join((_LENGTH.pack(sum(map(len, parts)) + TAG_BYTES), *parts, tag))

    def open(self, body: bytes) -> bytes:
        """A received frame's body without its tag; ProtocolError if the tag does not match."""
        if len(body) < TAG_BYTES:
            raise ProtocolError(f"a frame of {len(body)} bytes, too short for its tag")
        data = body[:-TAG_BYTES]
        if not hmac.compare_digest(body[-TAG_BYTES:], self._tag(self._receives, self._received, (data,))):
            raise ProtocolError("a frame whose tag does not match: altered, out of order, or not from the peer that proved itself")
        self._received += 1
        return data

    def _tag(self, direction: bytes, number: int, parts: Sequence[bytes]) -> bytes:
        tag = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES, salt=number.to_bytes(16, "little"), person=direction)
        for part in parts:
            tag.update(part)
        return tag.digest()


class KeyBudget:
    """How many keys a connection may have answered: `keys_per_s` on average, `burst` at
    once (a token bucket). A request waits until the bucket holds its keys, or the whole
    burst for a request larger than that, and then takes its keys (the bucket going into
    debt for what it lacked)."""

    def __init__(self, keys_per_s: float, burst: int, clock: Callable[[], float]) -> None:
        self._rate = keys_per_s
        self._burst = burst
        self._clock = clock
        self._keys = float(burst)
        self._at = clock()

    def wait_s(self, keys: int) -> float:
        """0 once a request of `keys` may go (its keys then taken), else how long until it may."""
        now = self._clock()
        self._keys = min(self._burst, self._keys + (now - self._at) * self._rate)
        self._at = now
        short = min(keys, self._burst) - self._keys
        if short > 0:
            return short / self._rate
        self._keys -= keys
        return 0.0


class QueryServer:
    """Serves one shard's queries on the shard's event loop.

    `answer(keys)` is the shard's encoded answer; it runs on the loop, between the shard's
    other calls, one request after another per connection. An exception it raises goes
    back as that request's error; a connection that breaks the protocol, or does not
    prove it holds `token`, is closed. What each connection may take: the module's
    docstring. `waiting`: the connections whose next request waits for their budget now.
    """

    def __init__(
        self, answer: Callable[[list[OffloadKey]], bytes], namespace: str, token: bytes,
        check_namespace: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a token of {len(token)} bytes: must be {TOKEN_BYTES}")
        self._answer = answer
        self._namespace = namespace
        self._token = token
        self._check_namespace = check_namespace
        self._clock = clock
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # of the connections open now
        self._proving: set[asyncio.StreamWriter] = set()  # of those not yet proven
        self._serving: set[asyncio.StreamWriter] = set()  # of those proven and answered
        self.waiting = 0

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
        if len(self._proving) >= MAX_HANDSHAKES:
            writer.transport.abort()
            return
        peer = writer.get_extra_info("peername")
        self._writers.add(writer)
        self._proving.add(writer)
        try:
            try:
                session = await asyncio.wait_for(self._handshake(reader, writer, peer), HELLO_TIMEOUT_S)
            finally:
                self._proving.discard(writer)
            if session is not None:
                await self._answer_requests(reader, writer, session)
        except asyncio.TimeoutError:
            logger.debug("query channel: %s did not prove itself within %s s; closed", peer, HELLO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if isinstance(e, ProtocolError):
                logger.warning("query channel: %s: %s; closed", peer, e)
        finally:
            self._writers.discard(writer)
            self._serving.discard(writer)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer) -> Session | None:
        """Prove this end to the client and have it prove itself; its Session if it did and
        was welcomed, else None (refused: the reason written)."""
        hello = await _read_frame(reader, NONCE_BYTES + MAX_NAMESPACE_BYTES)
        if len(hello) < NONCE_BYTES:
            raise ProtocolError(f"a hello of {len(hello)} bytes, without its nonce")
        client_nonce, namespace = hello[:NONCE_BYTES], hello[NONCE_BYTES:]
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(_frame(server_nonce + _proof(self._token, _SERVER_PROOF, client_nonce, server_nonce, namespace)))
        proof = await _read_frame(reader, PROOF_BYTES)
        if not hmac.compare_digest(proof, _proof(self._token, _CLIENT_PROOF, client_nonce, server_nonce, namespace)):
            logger.warning("query channel: %s did not prove it holds the token; closed", peer)
            return None
        session = Session(self._token, client_nonce, server_nonce, namespace, client=False)
        try:
            self._check_namespace(namespace.decode())
            if len(self._serving) >= MAX_CONNECTIONS:
                raise ValueError(f"the shard serves {MAX_CONNECTIONS} connections at most, and has as many")
        except (ValueError, UnicodeDecodeError) as e:
            writer.write(session.frame(bytes([ERROR]), str(e).encode()[:MAX_REASON_BYTES]))
            return None
        self._serving.add(writer)
        writer.write(session.frame(bytes([OK])))
        return session

    async def _answer_requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Session) -> None:
        budget = KeyBudget(KEYS_PER_S, KEY_BURST, self._clock)
        while True:
            request_id, keys = decode_keys(session.open(await _read_frame(reader, MAX_REQUEST_BYTES + TAG_BYTES)))
            while (wait_s := budget.wait_s(len(keys))) > 0:
                self.waiting += 1
                try:
                    await asyncio.sleep(wait_s)
                finally:
                    self.waiting -= 1
            try:
                status, payload = OK, self._answer(keys)
            except Exception as e:
                status, payload = ERROR, f"{type(e).__name__}: {e}".encode()
            writer.write(session.frame(_ANSWER_HEAD.pack(request_id, status), payload))
            await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > limit:
        raise ProtocolError(f"a frame of {length} bytes, over {limit}")
    return await reader.readexactly(length)


def client_handshake(sock: socket.socket, token: bytes, namespace: str) -> Session:
    """Prove this end to the server on `sock` and have it prove itself; the connection's
    Session once the server welcomed it. UnprovenError if the server does not prove it
    holds `token`, RefusedError if it refuses the connection (the reason its message)."""
    if type(token) is not bytes or len(token) != TOKEN_BYTES:
        what = f"{len(token)} bytes" if isinstance(token, bytes) else f"a {type(token).__name__}"
        raise ValueError(f"the shard's token is {what}, not {TOKEN_BYTES} bytes")
    name = namespace.encode()
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_frame(client_nonce + name))
    challenge = _recv_frame(sock, NONCE_BYTES + PROOF_BYTES)
    if len(challenge) != NONCE_BYTES + PROOF_BYTES:
        raise ProtocolError(f"a challenge of {len(challenge)} bytes, not {NONCE_BYTES + PROOF_BYTES}")
    server_nonce, proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(token, _SERVER_PROOF, client_nonce, server_nonce, name)):
        raise UnprovenError("the server did not prove it holds the shard's token: it is not the shard whose endpoint Ray gave")
    sock.sendall(_frame(_proof(token, _CLIENT_PROOF, client_nonce, server_nonce, name)))
    session = Session(token, client_nonce, server_nonce, name, client=True)
    welcome = session.open(_recv_frame(sock, 1 + MAX_REASON_BYTES + TAG_BYTES))
    if welcome[:1] != bytes([OK]):
        raise RefusedError(welcome[1:].decode(errors="replace"))
    return session


class QueryChannel:
    """One process's connection to one shard's `QueryServer`, for queries of `namespace`.

    `query(keys)` writes its request and returns the Future of the encoded answer, which
    the channel's reader thread sets; it raises ConnectionError at once when the channel
    is not connected (`connected`), so that the caller sends the query another way.
    `connect()` starts connecting in the background: `endpoint()` is the Future of the
    shard's (host, port, token) (its Ray method), then the handshake (`client_handshake`).
    Every answer is checked to come from the server that proved itself and handed on as
    it came, bytes for the caller to decode (`distkv.directory.wire.decode_answer`). A lost connection fails
    every request in flight with ConnectionError; the next `connect()` tries again after
    RECONNECT_DELAY_S, doubled after each failed try in a row up to MAX_RECONNECT_DELAY_S.
    Thread-safe.
    """

    def __init__(
        self, endpoint: Callable[[], Future], namespace: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._endpoint = endpoint
        self._namespace = namespace
        self._clock = clock
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None  # set once the server welcomed this channel
        self._session: Session | None = None  # the connection's, with `_socket`
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
        # on the wire once sent, so it cannot be taken back: a caller's cancel() says False,
        # and the reader thread always sets what comes (or fails it with the connection)
        future.set_running_or_notify_cancel()
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
                frame = self._session.frame(encode_keys(request_id, keys))
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
        self._socket = self._session = None
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
            session = client_handshake(sock, token, self._namespace)
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
            self._socket, self._session = sock, session
            self._failed_tries = 0
        self._read(sock, session)

    def _read(self, sock: socket.socket, session: Session) -> None:
        """The reader thread: set each answer's Future until the connection ends."""
        try:
            while True:
                body = session.open(_recv_frame(sock, _ANSWER_HEAD.size + MAX_ANSWER_BYTES + TAG_BYTES))
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

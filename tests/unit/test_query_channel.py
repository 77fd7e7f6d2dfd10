"""The query channel: a shard's queries over a TCP connection of their own (no Ray)."""

import asyncio
import socket
import struct
import threading
from concurrent.futures import Future

import pytest
from directory_fakes import Clock

from distkv.directory.wire import MAX_CALL_KEYS
from distkv.storage.slots import MAX_KEY_BYTES
from distkv.directory import query_channel
from distkv.directory.query_channel import (
    _CLIENT_PROOF,
    _SERVER_PROOF,
    MAX_RECONNECT_DELAY_S,
    MAX_REQUEST_BYTES,
    RECONNECT_DELAY_S,
    STALE_ANSWER_S,
    KeyBudget,
    ProtocolError,
    QueryChannel,
    QueryServer,
    RefusedError,
    Session,
    UnprovenError,
    _proof,
    channel_allowed,
    client_handshake,
    decode_keys,
    encode_keys,
)

NAMESPACE = "ns"
TOKEN = bytes(range(32))
WAIT_S = 30.0


def check_namespace(namespace: str) -> None:
    if namespace != NAMESPACE:
        raise ValueError(f"serves {NAMESPACE!r}, refuses {namespace!r}")


class Shard:
    """A QueryServer on an event loop of its own thread, as on a shard's; it answers a
    query with its keys joined, refuses keys starting with b"bad", and holds its answers
    while `hold` is clear."""

    def __init__(self, clock=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.hold = threading.Event()
        self.hold.set()
        self.dying = False
        self.asked: list[list[bytes]] = []
        self.server = QueryServer(self.answer, NAMESPACE, TOKEN, check_namespace, **({"clock": clock} if clock else {}))
        self.address = self.run(self.server.start("127.0.0.1"))

    def answer(self, keys: list[bytes]) -> bytes:
        self.hold.wait(WAIT_S)
        if self.dying:  # its process dies in the middle of the call
            self.server.close()
            raise SystemError("died")
        self.asked.append(keys)
        if keys and keys[0].startswith(b"bad"):
            raise ValueError("a bad key")
        return b"|".join(keys)

    async def _close(self) -> None:
        self.server.close()
        await asyncio.sleep(0.01)  # the aborted connections' transports close on the loop's next turns

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(WAIT_S)

    def endpoint(self, token: bytes = TOKEN):
        future: Future = Future()
        future.set_result((*self.address, token))
        return lambda: future

    def kill(self) -> None:
        """Die as a process does: every connection closed, what is in flight unanswered."""
        self.dying = True
        self.hold.set()

    def stop(self) -> None:
        self.hold.set()
        self.run(self._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


@pytest.fixture
def shard():
    s = Shard()
    yield s
    s.stop()


def connected(channel: QueryChannel) -> QueryChannel:
    channel.connect()
    wait_until(lambda: not channel.connecting)
    assert channel.connected, channel.last_error
    return channel


def wait_until(predicate) -> None:
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if predicate():
            return
        done.wait(0.01)
    pytest.fail(f"not true within {WAIT_S} s")


def test_keys_cross_as_they_were():
    keys = [b"", b"k" * 36, bytes(range(256)) * 255]
    assert decode_keys(encode_keys(7, keys)) == (7, keys)


@pytest.mark.parametrize(
    "body, problem",
    [(b"\0\0", "no id"), (b"\0\0\0\0\x05", "inside a key's length"), (b"\0\0\0\0\x05\0abc", "inside a key")],
)
def test_a_request_cut_short_is_a_protocol_error(body, problem):
    with pytest.raises(ProtocolError, match=problem):
        decode_keys(body)


def test_a_key_or_query_too_long_to_frame_is_refused_before_sending():
    with pytest.raises(ValueError, match="65,535"):
        encode_keys(0, [bytes(1 << 16)])
    with pytest.raises(ValueError, match="over"):
        encode_keys(0, [bytes(60000)] * (MAX_REQUEST_BYTES // 60000 + 1))


def test_queries_in_flight_get_their_own_answers(shard):
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    shard.hold.clear()
    futures = [channel.query([b"a%d" % i, b"b%d" % i]) for i in range(50)]
    shard.hold.set()
    assert [f.result(WAIT_S) for f in futures] == [b"a%d|b%d" % (i, i) for i in range(50)]
    channel.close()


def test_a_query_in_flight_cannot_be_cancelled_and_the_channel_answers_on(shard):
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    shard.hold.clear()
    first = channel.query([b"first"])
    assert not first.cancel()  # on the wire: a caller that gives up on it lets it be
    shard.hold.set()
    assert first.result(WAIT_S) == b"first"
    assert channel.query([b"next"]).result(WAIT_S) == b"next"  # the reader thread lives on
    channel.close()


def test_a_query_the_shard_fails_fails_alone(shard):
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    with pytest.raises(RuntimeError, match="ValueError: a bad key"):
        channel.query([b"bad"]).result(WAIT_S)
    assert channel.query([b"good"]).result(WAIT_S) == b"good"
    channel.close()


def test_a_wrong_token_gets_no_answer_and_asks_nothing(shard):
    channel = QueryChannel(shard.endpoint(token=bytes(32)), NAMESPACE)
    channel.connect()
    wait_until(lambda: not channel.connecting)
    assert not channel.connected
    assert isinstance(channel.last_error, ConnectionError)
    with pytest.raises(ConnectionError, match="not connected"):
        channel.query([b"k"])
    assert shard.asked == []


def test_a_token_of_the_wrong_size_is_refused_by_the_server():
    with pytest.raises(ValueError, match="must be 32"):
        QueryServer(lambda keys: b"", NAMESPACE, b"short", check_namespace)


def test_another_namespace_is_refused_with_the_reason(shard):
    channel = QueryChannel(shard.endpoint(), "other")
    channel.connect()
    wait_until(lambda: not channel.connecting)
    assert isinstance(channel.last_error, RefusedError)
    assert "refuses 'other'" in str(channel.last_error)
    assert not channel.connected


def test_a_connection_that_breaks_the_protocol_is_closed_and_the_others_go_on(shard):
    good = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    rogue = socket.create_connection(shard.address, timeout=WAIT_S)
    session = client_handshake(rogue, TOKEN, NAMESPACE)  # welcomed
    rogue.sendall(session.frame(b"\0\0\0\0\x09"))  # a key's length cut short
    assert rogue.recv(1) == b""  # closed, nothing answered
    rogue.close()
    assert good.query([b"k"]).result(WAIT_S) == b"k"
    assert shard.asked == [[b"k"]]
    good.close()


def test_a_lost_shard_fails_the_queries_in_flight_and_the_channel_connects_again():
    clock = Clock()
    shard = Shard()
    endpoints = [shard.endpoint()]  # what the shard's Ray method answers: its live incarnation's
    channel = connected(QueryChannel(lambda: endpoints[0](), NAMESPACE, clock=clock))
    shard.hold.clear()
    in_flight = channel.query([b"k"])
    shard.kill()
    with pytest.raises(ConnectionError):
        in_flight.result(WAIT_S)
    assert not channel.connected
    with pytest.raises(ConnectionError, match="not connected"):
        channel.query([b"k"])

    restarted = Shard()
    endpoints[0] = restarted.endpoint()
    channel.connect()  # too soon: waits RECONNECT_DELAY_S
    assert not channel.connected and not channel.connecting
    clock.now += RECONNECT_DELAY_S
    connected(channel)
    assert channel.query([b"again"]).result(WAIT_S) == b"again"
    channel.close()
    restarted.stop()
    shard.stop()


def test_a_shard_that_stops_answering_closes_the_channel(shard):
    clock = Clock()
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE, clock=clock))
    shard.hold.clear()
    unanswered = channel.query([b"k"])
    clock.now += STALE_ANSWER_S / 2
    waiting = channel.query([b"j"])  # not stale yet
    clock.now += STALE_ANSWER_S
    with pytest.raises(ConnectionError, match="no answer within"):
        channel.query([b"m"])
    for future in (unanswered, waiting):
        with pytest.raises(ConnectionError):
            future.result(WAIT_S)
    assert not channel.connected
    shard.hold.set()


def test_a_request_the_socket_cannot_take_whole_closes_the_channel_instead_of_waiting(shard):
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    shard.hold.clear()  # the shard reads one request and then nothing
    big = [bytes(MAX_KEY_BYTES)] * MAX_CALL_KEYS  # ~360 KB a request
    sent = []
    with pytest.raises(ConnectionError, match="part of a request|sending failed"):
        for _ in range(1000):
            sent.append(channel.query(big))
    assert sent, "the socket's buffers took no request at all"
    assert all(isinstance(f.exception(WAIT_S), ConnectionError) for f in sent)
    assert not channel.connected
    shard.hold.set()


def test_a_closed_channel_fails_its_queries_and_does_not_connect_again(shard):
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    shard.hold.clear()
    in_flight = channel.query([b"k"])
    channel.close()
    with pytest.raises(ConnectionError, match="closed"):
        in_flight.result(WAIT_S)
    channel.connect()
    assert not channel.connecting and not channel.connected
    shard.hold.set()


def test_a_failed_query_s_callback_may_query_again_without_deadlock(shard):
    channel = connected(QueryChannel(shard.endpoint(), NAMESPACE))
    shard.hold.clear()
    again: list[BaseException] = []

    def query_again(_):
        try:
            channel.query([b"x"])
        except ConnectionError as e:
            again.append(e)

    channel.query([b"k"]).add_done_callback(query_again)
    channel.close()
    assert len(again) == 1
    shard.hold.set()


@pytest.mark.parametrize("value, allowed", [(None, True), ("0", True), ("1", False), ("true", False), ("True", False)])
def test_no_channel_where_ray_encrypts_its_own_traffic(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv("RAY_USE_TLS", raising=False)
    else:
        monkeypatch.setenv("RAY_USE_TLS", value)
    assert channel_allowed() is allowed


def test_failed_connections_try_again_ever_later_and_a_success_starts_over(shard):
    clock = Clock()
    tries = []  # when the channel asked for the endpoint: one per try
    endpoints = [shard.endpoint(token=bytes(32))]

    def endpoint():
        tries.append(clock.now)
        return endpoints[0]()

    channel = QueryChannel(endpoint, NAMESPACE, clock=clock)

    def next_try_after() -> float:
        """Seconds of the clock until `connect()` starts another try; waits for that try to end."""
        at, before = clock.now, len(tries)
        while True:
            channel.connect()
            if channel.connecting or len(tries) > before:  # started (and maybe ended already)
                break
            clock.now += RECONNECT_DELAY_S / 4
        wait_until(lambda: not channel.connecting)
        return clock.now - at

    assert next_try_after() == 0  # the first try goes at once, and fails
    delays = [next_try_after() for _ in range(8)]
    assert delays == [RECONNECT_DELAY_S * 2**i for i in range(6)] + [MAX_RECONNECT_DELAY_S] * 2
    assert not channel.connected

    endpoints[0] = shard.endpoint()
    assert next_try_after() == MAX_RECONNECT_DELAY_S
    assert channel.connected
    shard.hold.clear()
    channel.query([b"k"])
    shard.kill()  # in the middle of that query: a lost connection after a success waits the first delay again
    wait_until(lambda: not channel.connected)
    assert next_try_after() == RECONNECT_DELAY_S


# ---- both ends prove they hold the token; frames are tagged (issue 31, finding 2) --------


class Impostor:
    """Whatever listens on a port where a shard's channel was (a local user who bound it
    after the shard died, anyone on the path), without the shard's token: it reads what
    the client sends and answers as `how` says, then welcomes and answers anything."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.received = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def endpoint(self):
        future: Future = Future()
        future.set_result((*self.address, TOKEN))  # what the shard's Ray method gave, before it died
        return lambda: future

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(WAIT_S)
        try:
            self.received += conn.recv(65536)  # the hello
            if self.how == "guesses a proof":
                conn.sendall(struct.pack("<I", 64) + bytes(64))  # a nonce and a proof made without the token
                self.received += conn.recv(65536)
            conn.sendall(struct.pack("<I", 1) + b"\0")  # welcome
            while chunk := conn.recv(65536):
                self.received += chunk
                conn.sendall(struct.pack("<I", 5) + b"\0\0\0\0\0")  # "answer" request 0
        except OSError:
            pass
        finally:
            conn.close()
            self.listener.close()


@pytest.mark.parametrize("how", ["welcomes at once", "guesses a proof"])
def test_the_client_never_sends_its_token_and_refuses_a_server_without_it(how):
    impostor = Impostor(how)
    channel = QueryChannel(impostor.endpoint(), NAMESPACE)
    channel.connect()
    wait_until(lambda: not channel.connecting)
    assert not channel.connected
    assert isinstance(channel.last_error, ConnectionError)
    if how == "guesses a proof":
        assert isinstance(channel.last_error, UnprovenError)
    with pytest.raises(ConnectionError, match="not connected"):
        channel.query([b"k"])
    assert TOKEN not in impostor.received


def test_the_proofs_bind_both_nonces_and_the_namespace():
    proofs = {
        _proof(TOKEN, role, cn, sn, ns)
        for role in (_SERVER_PROOF, _CLIENT_PROOF)
        for cn in (bytes(32), b"\1" * 32)
        for sn in (bytes(32), b"\1" * 32)
        for ns in (b"ns", b"other")
    }
    assert len(proofs) == 16
    assert _proof(bytes(32), _SERVER_PROOF, bytes(32), bytes(32), b"ns") != _proof(TOKEN, _SERVER_PROOF, bytes(32), bytes(32), b"ns")


def sessions(token: bytes = TOKEN, namespace: bytes = b"ns") -> tuple[Session, Session]:
    """The client's and the server's Session of one connection."""
    cn, sn = b"c" * 32, b"s" * 32
    return Session(token, cn, sn, namespace, client=True), Session(token, cn, sn, namespace, client=False)


def body_of(frame: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", frame)
    assert length == len(frame) - 4
    return frame[4:]


def test_a_tagged_frame_opens_once_in_its_place_and_only_on_its_connection():
    client, server = sessions()
    first, second = body_of(client.frame(b"one")), body_of(client.frame(b"two"))
    with pytest.raises(ProtocolError, match="tag does not match"):
        server.open(second)  # out of order
    assert server.open(first) == b"one"
    with pytest.raises(ProtocolError, match="tag does not match"):
        server.open(first)  # replayed
    assert server.open(second) == b"two"
    answer = body_of(server.frame(b"head", b"payload"))
    altered = answer[:2] + bytes([answer[2] ^ 1]) + answer[3:]
    with pytest.raises(ProtocolError, match="tag does not match"):
        client.open(altered)
    assert client.open(answer) == b"headpayload"

    other_client, _ = sessions(token=bytes(32))
    _, other_namespace = sessions(namespace=b"other")
    for stranger in (other_client, other_namespace):
        with pytest.raises(ProtocolError, match="tag does not match"):
            stranger.open(answer)
    reflected_client, _ = sessions()
    with pytest.raises(ProtocolError, match="tag does not match"):
        reflected_client.open(body_of(sessions()[0].frame(b"x")))  # a client's own frame sent back to it
    with pytest.raises(ProtocolError, match="too short"):
        client.open(b"short")


# ---- what a shard's server spends on its connections (issue 31, finding 3) ---------------


def closed_by_the_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock`, reading what it sent before (waits up to WAIT_S)."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_connections_that_do_not_prove_themselves_in_time_are_closed(shard, monkeypatch):
    monkeypatch.setattr(query_channel, "HELLO_TIMEOUT_S", 0.2)
    idle = [socket.create_connection(shard.address, timeout=WAIT_S) for _ in range(20)]
    hello_only = socket.create_connection(shard.address, timeout=WAIT_S)
    hello_only.sendall(struct.pack("<I", 34) + bytes(32) + NAMESPACE.encode())  # and never its proof
    assert all(closed_by_the_server(sock) for sock in idle + [hello_only])
    for sock in idle + [hello_only]:
        sock.close()
    assert connected(QueryChannel(shard.endpoint(), NAMESPACE)).query([b"k"]).result(WAIT_S) == b"k"


def test_connections_past_the_cap_of_those_proving_themselves_are_closed_at_once(shard, monkeypatch):
    monkeypatch.setattr(query_channel, "MAX_HANDSHAKES", 4)
    idle = [socket.create_connection(shard.address, timeout=WAIT_S) for _ in range(4)]
    one_more = socket.create_connection(shard.address, timeout=WAIT_S)
    assert closed_by_the_server(one_more)
    for sock in idle + [one_more]:
        sock.close()
    wait_until(lambda: not shard.server._proving)
    assert connected(QueryChannel(shard.endpoint(), NAMESPACE)).query([b"k"]).result(WAIT_S) == b"k"


def test_proven_connections_past_the_cap_are_refused_with_the_reason(shard, monkeypatch):
    monkeypatch.setattr(query_channel, "MAX_CONNECTIONS", 2)
    first, second = (connected(QueryChannel(shard.endpoint(), NAMESPACE)) for _ in range(2))
    third = QueryChannel(shard.endpoint(), NAMESPACE)
    third.connect()
    wait_until(lambda: not third.connecting)
    assert not third.connected
    assert isinstance(third.last_error, RefusedError)
    assert "serves 2 connections at most" in str(third.last_error)
    first.close()
    wait_until(lambda: len(shard.server._serving) == 1)
    clock = Clock()
    fourth = connected(QueryChannel(shard.endpoint(), NAMESPACE, clock=clock))
    assert fourth.query([b"k"]).result(WAIT_S) == b"k"
    assert second.query([b"j"]).result(WAIT_S) == b"j"


def test_a_request_over_its_connection_s_budget_waits_and_the_others_are_answered_meanwhile(monkeypatch):
    monkeypatch.setattr(query_channel, "KEYS_PER_S", 100)
    monkeypatch.setattr(query_channel, "KEY_BURST", 10)
    clock = Clock()
    shard = Shard(clock=clock)
    try:
        greedy, other = (connected(QueryChannel(shard.endpoint(), NAMESPACE)) for _ in range(2))
        keys = [b"k%d" % i for i in range(10)]
        assert greedy.query(keys).result(WAIT_S) == b"|".join(keys)  # the burst
        over = greedy.query(keys)
        wait_until(lambda: shard.server.waiting == 1)
        assert other.query([b"j"]).result(WAIT_S) == b"j"  # the loop is not held
        assert not over.done()
        clock.now += 0.1  # 10 keys at 100 a second
        assert over.result(WAIT_S) == b"|".join(keys)
        assert shard.asked == [keys, [b"j"], keys]
    finally:
        shard.stop()


def test_a_budget_gives_its_burst_then_its_rate_and_lets_a_larger_request_go_into_debt():
    clock = Clock()
    budget = KeyBudget(64, 8, clock)  # figures exact in binary
    assert budget.wait_s(6) == 0
    assert budget.wait_s(6) == 4 / 64
    clock.now += 4 / 64
    assert budget.wait_s(6) == 0
    clock.now += 1.0
    assert budget.wait_s(40) == 0  # a full bucket lets a larger request go...
    assert budget.wait_s(1) == 33 / 64  # ...which the rate then pays back
    clock.now += 33 / 64
    assert budget.wait_s(1) == 0


def test_a_request_of_more_keys_than_a_call_carries_is_a_protocol_error():
    with pytest.raises(ValueError, match=f"{MAX_CALL_KEYS} at most"):
        encode_keys(0, [b"k"] * (MAX_CALL_KEYS + 1))
    body = struct.pack("<I", 0) + (struct.pack("<H", 1) + b"k") * (MAX_CALL_KEYS + 1)
    with pytest.raises(ProtocolError, match=f"more than {MAX_CALL_KEYS} keys"):
        decode_keys(body)

"""The query channel: a shard's queries over a TCP connection of their own (no Ray)."""

import asyncio
import socket
import struct
import threading
from concurrent.futures import Future

import pytest
from directory_fakes import Clock

from distkv.query_channel import (
    MAX_RECONNECT_DELAY_S,
    MAX_REQUEST_BYTES,
    RECONNECT_DELAY_S,
    STALE_ANSWER_S,
    ProtocolError,
    QueryChannel,
    QueryServer,
    RefusedError,
    channel_allowed,
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

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.hold = threading.Event()
        self.hold.set()
        self.dying = False
        self.asked: list[list[bytes]] = []
        self.server = QueryServer(self.answer, NAMESPACE, TOKEN, check_namespace)
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
    assert decode_keys(encode_keys(7, keys)[4:]) == (7, keys)


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
    rogue.sendall(struct.pack("<I", len(TOKEN) + 2) + TOKEN + NAMESPACE.encode())
    assert rogue.recv(5) == struct.pack("<I", 1) + b"\0"  # welcomed
    rogue.sendall(struct.pack("<I", 5) + b"\0\0\0\0\x09")  # a key's length cut short
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
    big = [bytes(250)] * 4000  # ~1 MB a request
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

"""What a Directory shard takes in bulk (a register's entries, a publish's changes, the
publishes a relay carries): bounded, typed plain data only (msgpack: a pickle does not even
read), checked before anything is applied (issue 31, finding 4; no Ray)."""

import pickle

import msgpack
import pytest
from pickle_bomb import EXPLODED, Bomb
from directory_fakes import key

from distkv.config import DIRECTORY_FORMAT
from distkv.directory.wire import (
    MAX_CALL_KEYS,
    MAX_PAYLOAD_BYTES,
    MAX_RELAYED_PUBLISHES,
    decode_answer,
    decode_changes,
    decode_stored,
    encode_answer,
    encode_changes,
    encode_stored,
)
from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo

A = ReplicaInfo("a", "node-1", "distkv-ns-a", 1 << 13, 1, 4096)
B = ReplicaInfo("b", "node-2", "distkv-ns-b", 64, 1, 4096)
def test_a_payload_of_plain_data_crosses_encoded():
    stored = [(key(1), 3, 2**64 - 1), (key(2), 0, 7)]
    assert decode_stored(encode_stored(stored), "register") == stored
    assert decode_changes(encode_changes(stored, [key(3)]), "publish") == (stored, [key(3)])


@pytest.mark.parametrize(
    "data, problem",
    [
        (pickle.dumps([(Bomb(), 1, 1)]), "register: not msgpack of this format"),
        (pickle.dumps(Bomb()), "not msgpack of this format"),
        (pickle.dumps([ReplicaInfo("x", "n", "p", 1, 1, 1)]), "not msgpack of this format"),
        (msgpack.packb((DIRECTORY_FORMAT, [msgpack.ExtType(1, b"x")])), "not msgpack of this format"),
        (msgpack.packb((DIRECTORY_FORMAT - 1, [])), f"not a message of format {DIRECTORY_FORMAT}"),
        (b"\x80\x05garbage", "not msgpack of this format"),
        ("text", "a str, not bytes"),
        (bytes(MAX_PAYLOAD_BYTES + 1), f"over {MAX_PAYLOAD_BYTES}"),
    ],
    ids=["a bomb among the entries", "a bomb", "an object", "an extension type", "another format", "garbage", "not bytes", "too large"],
)
def test_a_payload_that_is_not_plain_data_of_its_size_is_refused_and_runs_nothing(data, problem):
    with pytest.raises(ValueError, match=problem):
        decode_stored(data, "register")
    assert not EXPLODED


def test_a_call_of_more_keys_than_a_call_carries_or_of_another_shape_is_refused():
    entries = [(key(i), i, 1) for i in range(MAX_CALL_KEYS + 1)]
    with pytest.raises(ValueError, match=f"register: {MAX_CALL_KEYS + 1} stored entries, over {MAX_CALL_KEYS}"):
        decode_stored(encode_stored(entries), "register")
    with pytest.raises(ValueError, match=f"publish: {MAX_CALL_KEYS + 1} keys, over {MAX_CALL_KEYS}"):
        decode_changes(encode_changes(entries[:-1], [key(0)]), "publish")
    with pytest.raises(ValueError, match="not a list of stored entries"):
        decode_stored(msgpack.packb((DIRECTORY_FORMAT, 7)), "register")
    with pytest.raises(ValueError, match="not a \\(stored, removed\\) pair"):
        decode_changes(msgpack.packb((DIRECTORY_FORMAT, 7, [])), "publish")


def test_a_relayed_publish_too_large_or_poisoned_is_refused_alone_and_the_others_applied():
    state = DirectoryState()
    state.register(A)
    state.register(B)
    good = ("b", 1, encode_changes([(key(1), 0, 1)], []), None)
    poisoned = ("a", 1, pickle.dumps(([(Bomb(), 0, 1)], [])), None)
    too_large = ("a", 2, encode_changes([(key(i), i, 1) for i in range(MAX_CALL_KEYS + 1)], []), None)
    results = state.publish_relayed([poisoned, too_large, good])
    assert "not msgpack of this format" in results[0]
    assert f"over {MAX_CALL_KEYS}" in results[1]
    assert results[2] is True
    assert not EXPLODED
    assert state.query([key(1), key(2)]) == [(("b", "node-2", 0, 1),), ()]
    assert state.stats()["stored"] == 1


def test_a_relay_s_call_of_more_publishes_than_a_call_carries_is_refused_whole():
    state = DirectoryState()
    state.register(B)
    item = ("b", 1, encode_changes([(key(1), 0, 1)], []), None)
    with pytest.raises(ValueError, match=f"over {MAX_RELAYED_PUBLISHES}"):
        state.publish_relayed([item] * (MAX_RELAYED_PUBLISHES + 1))
    assert state.query([key(1)]) == [()]


@pytest.mark.parametrize("generation", [-1, 2**64])
def test_a_generation_outside_a_slot_s_u64_is_refused_so_that_every_answer_encodes(generation):
    """An answer carries generations as u64: one outside would fail every answer naming it."""
    state = DirectoryState()
    state.register(A)
    state.publish("a", 1, [(key(1), 0, 1)], [])
    with pytest.raises(ValueError, match=f"generation {generation} is not an int in 0..2\\*\\*64-1"):
        state.publish("a", 2, [(key(2), 1, generation)], [])
    holders, infos = state.answer([key(1), key(2)])
    assert decode_answer(encode_answer(holders, infos), 2)[0] == [(("a", "node-1", 0, 1),), ()]

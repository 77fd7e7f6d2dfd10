"""A Directory query's answer as it crosses: one typed format, one decoder that refuses
anything else with a clear error and never runs what it reads (no Ray)."""

import pickle

import msgpack
import numpy as np
import pytest
from pickle_bomb import EXPLODED, Bomb
from directory_fakes import key

from distkv.directory.wire import (
    ANSWER_FORMAT,
    MAX_ANSWER_BYTES,
    MAX_ENDPOINT_BYTES,
    MAX_NAME_BYTES,
    decode_answer,
    encode_answer,
)
from distkv.directory.wire import WireError as AnswerError
from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo

ENDPOINT = b"\x01a sealed endpoint\xff" * 40
A = ReplicaInfo("a", "node-1", "distkv-ns-a", 64, 2, 4096, cache_epoch=3, endpoint=ENDPOINT)
B = ReplicaInfo("b", "node-2", "distkv-ns-b", 8, 1, 4096)


def filled_state() -> DirectoryState:
    state = DirectoryState()
    for info in (A, B):
        state.register(info)
    state.publish("a", 1, [(key(1), 5, 2**64 - 1), (key(2), 63, 7)], [])
    state.publish("b", 1, [(key(2), 0, 1)], [])
    return state


def test_an_answer_crosses_as_the_state_gave_it():
    state = filled_state()
    keys = [key(1), key(2), key(3)]
    holders, infos = state.answer(keys)
    assert decode_answer(encode_answer(holders, infos), len(keys)) == (holders, infos)
    assert decode_answer(encode_answer(*state.answer([])), 0) == ([], {})


def message(replicas=None, counts=(1,), flat=(0, 5, 9), fmt=ANSWER_FORMAT) -> bytes:
    """An answer's msgpack as its parts say: `counts` and `flat` as lists of ints become the
    arrays they cross as, anything else crosses as it is."""
    if replicas is None:
        replicas = [["a", "node-1", "distkv-ns-a", 64, 2, 4096, 0, None]]
    if isinstance(counts, tuple):
        counts = np.array(counts, dtype="<u4").tobytes()
    if isinstance(flat, tuple):
        flat = np.array(flat, dtype="<u8").tobytes()
    return msgpack.packb([fmt, replicas, counts, flat])


REFUSED = [
    ("text", 1, "a str, not bytes"),
    (lambda: bytes(MAX_ANSWER_BYTES + 1), 1, "over"),
    (pickle.dumps(([((Bomb(),),)], {})), 1, "not msgpack|not a query answer"),
    (b"\xc1", 1, "not msgpack"),
    (msgpack.packb({"a": 1}), 1, "not msgpack|not a query answer"),
    (msgpack.packb(msgpack.ExtType(1, b"x")), 1, "not msgpack"),
    (message(fmt=2), 1, "format 1"),
    (message(), 2, "an answer of 1 keys to a query of 2"),
    (message(counts=(2,)), 1, "do not add up"),
    (message(counts=(1,), flat=(0, 5)), 1, "do not add up"),
    (message(counts=[1]), 1, "counts or holders are not bytes"),
    (message(flat=[0, 5, 9]), 1, "counts or holders are not bytes"),
    (message(counts=b"\1\0\0"), 1, "an answer of 0.75 keys"),
    (message(flat=(1, 5, 9)), 1, "names replica 1 of 1"),
    (message(flat=(0, 64, 9)), 1, "row 64 of a pool of 64"),
    (message(replicas=[["a", "node-1", "pool", 64, 2, 4096, 0]]), 1, "not a list of 8 fields"),
    (message(replicas=[["a", "node-1", "distkv-ns-a", True, 2, 4096, 0, None]]), 1, "True is not an int"),
    (message(replicas=[["", "node-1", "distkv-ns-a", 64, 2, 4096, 0, None]]), 1, "replica_id=''"),
    (message(replicas=[["a", "n", "p", 64, 2, 4096, 0, None]] * 2), 1, "names a replica twice"),
    (message(replicas=[["a" * (MAX_NAME_BYTES + 1), "n", "p", 64, 2, 4096, 0, None]]), 1, "not msgpack"),
    (message(replicas=[["a", "node-1", "p", 64, 2, 4096, 0, "text"]]), 1, "must be a sealed endpoint"),
    (message(replicas=[["a", "node-1", "p", 64, 2, 4096, 0, bytes(MAX_ENDPOINT_BYTES + 1)]]), 1, "endpoint of .* over"),
]


@pytest.mark.parametrize("data, num_keys, problem", REFUSED, ids=[problem for _, _, problem in REFUSED])
def test_anything_but_an_answer_to_the_query_is_refused_naming_the_problem(data, num_keys, problem):
    with pytest.raises(AnswerError, match=problem):
        decode_answer(data() if callable(data) else data, num_keys)
    assert not EXPLODED

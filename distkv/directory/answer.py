"""A Directory query's answer as it crosses, typed and bounded.

A query's answer (each key's holders, and the `ReplicaInfo` of every replica they name) has
one format however it travels, as what the shard's Ray method `query` returns or over its
query channel (`distkv.directory.query_channel`), and one reader, `decode_answer`: msgpack of lists,
ints, strs and bytes, every size bounded and every field checked, so that whoever answers
can at worst answer wrongly, never run code or exhaust the asker. The holders cross as two
little-endian arrays, each key's count (u32) and each holder's (index of its replica among
those named, row, generation) (u64), read and checked whole (numpy); a holder's node is its
replica's, as a shard keeps it (`DirectoryState.publish` takes a holder's node from its
replica's info).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import msgpack
import numpy as np

from distkv.directory.records import HolderFields, ReplicaInfo

# An answer names each key's holders (every replica of the namespace, at worst) and their infos.
MAX_ANSWER_BYTES = 1 << 26
# A str of an answer (a replica's id, node, pool name) and a sealed endpoint, at most.
MAX_NAME_BYTES = 1 << 12
MAX_ENDPOINT_BYTES = 1 << 20

ANSWER_FORMAT = 1
# the holders' count of each key, and each holder's (index of its replica, row, generation)
_COUNT = np.dtype("<u4")
_FIELD = np.dtype("<u8")
_REPLICA_FIELDS = 8  # ReplicaInfo's, in order


class AnswerError(ValueError):
    """Bytes that are not a query answer of this format, or not one to the query asked."""


def encode_answer(holders: Sequence[tuple[HolderFields, ...]], infos: Mapping[str, ReplicaInfo]) -> bytes:
    """`DirectoryState.answer`'s (holders of each key, info of each replica they name), as it crosses."""
    index: dict[str, int] = {}
    replicas = []
    for replica_id, info in infos.items():
        index[replica_id] = len(replicas)
        replicas.append([
            info.replica_id, info.node_id, info.pool_name, info.num_rows, info.num_ranks, info.slot_bytes,
            info.cache_epoch, info.endpoint,
        ])
    counts = []
    flat: list[int] = []
    for key_holders in holders:
        counts.append(len(key_holders))
        for replica_id, _, row, generation in key_holders:
            flat += (index[replica_id], row, generation)
    counts_bytes = np.array(counts, dtype=_COUNT).tobytes()
    return msgpack.packb([ANSWER_FORMAT, replicas, counts_bytes, np.array(flat, dtype=_FIELD).tobytes()])


def decode_answer(data: object, num_keys: int) -> tuple[list[tuple[HolderFields, ...]], dict[str, ReplicaInfo]]:
    """The (holders of each key, ReplicaInfo of each replica they name) of an answer to a
    query of `num_keys` keys; AnswerError, naming the problem, for anything else."""
    if type(data) is not bytes:
        raise AnswerError(f"a query answer is a {type(data).__name__}, not bytes")
    if len(data) > MAX_ANSWER_BYTES:
        raise AnswerError(f"a query answer of {len(data)} bytes, over {MAX_ANSWER_BYTES}")
    try:
        message = msgpack.unpackb(
            data, raw=False, max_str_len=MAX_NAME_BYTES, max_bin_len=MAX_ANSWER_BYTES, max_map_len=0, max_ext_len=0
        )
    except Exception as e:
        raise AnswerError(f"a query answer that is not msgpack of this format: {type(e).__name__}: {e}") from None
    if type(message) is not list or len(message) != 4 or message[0] != ANSWER_FORMAT:
        raise AnswerError(f"not a query answer of format {ANSWER_FORMAT}: {message!r:.80}")
    _, replicas, counts_bytes, fields_bytes = message
    if type(replicas) is not list or type(counts_bytes) is not bytes or type(fields_bytes) is not bytes:
        raise AnswerError("a query answer whose replicas are not a list, or whose counts or holders are not bytes")
    if len(counts_bytes) != num_keys * _COUNT.itemsize:
        raise AnswerError(f"an answer of {len(counts_bytes) / _COUNT.itemsize:g} keys to a query of {num_keys}")
    counts = np.frombuffer(counts_bytes, _COUNT)
    if len(fields_bytes) != 3 * _FIELD.itemsize * int(counts.sum(dtype=np.uint64)):
        raise AnswerError(f"a query answer whose counts of holders do not add up to its {len(fields_bytes) // 24} holders")
    named = [_replica_info(fields) for fields in replicas]
    infos = {info.replica_id: info for info in named}
    if len(infos) != len(named):
        raise AnswerError("a query answer that names a replica twice")
    fields = np.frombuffer(fields_bytes, _FIELD).reshape(-1, 3)
    if len(fields):
        replica = fields[:, 0]
        if int(replica.max()) >= len(named):
            raise AnswerError(f"a query answer's holder names replica {int(replica.max())} of {len(named)}")
        num_rows = np.array([info.num_rows for info in named], dtype=_FIELD)
        outside = np.flatnonzero(fields[:, 1] >= num_rows[replica])
        if len(outside):
            info, row = named[int(replica[outside[0]])], int(fields[outside[0], 1])
            raise AnswerError(f"a query answer's holder {info.replica_id!r} is in row {row} of a pool of {info.num_rows}")
    ids, nodes = [info.replica_id for info in named], [info.node_id for info in named]
    each = [(ids[replica], nodes[replica], row, generation) for replica, row, generation in fields.tolist()]
    if len(each) == num_keys and (not num_keys or counts.min() == 1):  # one holder a key, the common case
        return [(holder,) for holder in each], infos
    taken = iter(each)
    return [tuple(itertools.islice(taken, count)) for count in counts.tolist()], infos


def _replica_info(fields: object) -> ReplicaInfo:
    if type(fields) is not list or len(fields) != _REPLICA_FIELDS:
        raise AnswerError(f"a query answer's replica {fields!r:.80} is not a list of {_REPLICA_FIELDS} fields")
    for value in fields[3:7]:
        if type(value) is not int:
            raise AnswerError(f"a query answer's replica {fields[0]!r:.80}: {value!r} is not an int")
    endpoint = fields[7]
    if type(endpoint) is bytes and len(endpoint) > MAX_ENDPOINT_BYTES:
        raise AnswerError(f"a query answer's endpoint of {len(endpoint)} bytes, over {MAX_ENDPOINT_BYTES}")
    try:
        return ReplicaInfo(*fields[:7], endpoint=endpoint)
    except ValueError as e:
        raise AnswerError(f"a query answer's replica: {e}") from None

"""What a version before distkv's subpackages pickled by module path still loads
(docs/operations.md, "Rolling upgrades"): Ray pickles a call's arguments and results by
the module that defines each class, and a NodeAgent, node watcher or shard of one version
answers callers of the other."""

import pickle

import pytest

from distkv.directory.node_table import DeadNodesVersion
from distkv.directory.records import Changes, Cursor, Holder, ReplicaInfo
from distkv.observability.stats import BlockCounts, LookupCounts, PoolUsage, PromotionCounts, ReplicaStats, RoutingCounts
from distkv.storage.pool import PoolLoadStoreSpec
from distkv.storage.segments import UntrustedSegment
from distkv.storage.slots import Sealed

INFO = ReplicaInfo("a", "node-1", "distkv-ns-a", 64, 1, 4096)
STATS = ReplicaStats(
    "ns", "a", "node-1", 1.0, LookupCounts(1, 2, 3, 4), PromotionCounts({}, {}, {}, {}, 0, {}, {}),
    BlockCounts(1, 2, {}), PoolUsage(4, 2, 0, 4), RoutingCounts({}, {}, {}), {}, (),
)
# (the module that defined it before, the object)
CROSSING = [
    ("distkv.directory_state", INFO),
    ("distkv.directory_state", Cursor("epoch", 3, 1)),
    ("distkv.directory_state", Changes(Cursor("epoch", 3, 1), [], {"a": INFO}, False)),
    ("distkv.directory_state", Holder("a", "node-1", 5, 7)),
    ("distkv.pool", Sealed(4096, 123, 1)),
    ("distkv.node_table", DeadNodesVersion("epoch", 2)),
    ("distkv.stats", STATS),
]


def as_of_old(obj: object, old_module: str) -> bytes:
    """`obj` pickled as the old version pickled it: its class named by `old_module`."""
    data = pickle.dumps(obj, protocol=2)  # protocol 2 names a class as "module\nname\n"
    new = f"c{type(obj).__module__}\n{type(obj).__qualname__}\n".encode()
    assert new in data
    return data.replace(new, f"c{old_module}\n{type(obj).__qualname__}\n".encode())


@pytest.mark.parametrize("old_module, obj", CROSSING, ids=lambda x: x if isinstance(x, str) else type(x).__name__)
def test_a_pickle_naming_the_old_module_loads_as_the_same_object(old_module, obj):
    assert pickle.loads(as_of_old(obj, old_module)) == obj


def test_the_old_paths_of_a_pool_spec_and_a_refusal_load():
    spec = pickle.loads(as_of_old(PoolLoadStoreSpec([3], [b"k" * 8], [9]), "distkv.pool"))
    assert type(spec) is PoolLoadStoreSpec and list(spec.block_ids) == [3] and spec.keys == [b"k" * 8]
    refusal = pickle.loads(as_of_old(UntrustedSegment("not ours"), "distkv.segments"))
    assert type(refusal) is UntrustedSegment and refusal.args == ("not ours",)


def test_the_directory_package_names_the_records():
    import distkv.directory as directory

    assert (directory.ReplicaInfo, directory.Cursor, directory.Changes, directory.Holder) == (ReplicaInfo, Cursor, Changes, Holder)

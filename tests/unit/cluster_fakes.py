"""An in-memory Directory and link for testing the cluster manager without Ray."""

import collections
from concurrent.futures import Future

import numpy as np

from distkv.directory.records import Holder, ReplicaInfo
from distkv.observability.errors import ErrorLog
from distkv.storage.pool import HostPool
from distkv.storage.readers import read_rows
from distkv.transfer.promotion import layout_of


class FunctionFetch:
    """A RemoteFetch of a function of its call's signature, keeping nothing per node."""

    def __init__(self, fetch):
        self._fetch = fetch

    def __call__(self, info, rows, keys, gens):
        return self._fetch(info, rows, keys, gens)

    def forget_gone(self, replica_info):
        pass


def no_fetch(info, rows, keys, gens):
    """Reaches no node."""
    raise ConnectionError("no node agent in this test")


class FakeDirectory:
    def __init__(self):
        self.holders: dict[bytes, dict[str, Holder]] = {}
        self.infos: dict[str, ReplicaInfo] = {}


class FakeLink:
    """The DirectoryLink's interface over a FakeDirectory, applied at once."""

    namespace = "ns0"
    num_shards = 1
    ask = None  # the view holds everything: nothing to ask
    routed = False  # whether `answers_routed` was called

    def __init__(self, directory: FakeDirectory, info: ReplicaInfo):
        self.directory = directory
        self.info = info
        self.errors = ErrorLog()
        self.event_lags = collections.deque()
        self.query_times = collections.deque()
        directory.infos[info.replica_id] = info

    def stored(self, entries):
        for key, row, gen in entries:
            self.directory.holders.setdefault(key, {})[self.info.replica_id] = Holder(
                self.info.replica_id, self.info.node_id, row, gen
            )

    def stored_blocks(self, blocks):
        self.stored([(key, block.row, block.generation) for key, block in blocks])

    promoted_blocks = stored_blocks  # published at once: no delay to stand in for

    def removed(self, keys):
        for key in keys:
            self.directory.holders.get(key, {}).pop(self.info.replica_id, None)

    def removed_blocks(self, blocks):
        self.removed([key for key, _ in blocks])

    def holders(self, key):
        return tuple(h for r, h in self.directory.holders.get(key, {}).items() if r != self.info.replica_id)

    @property
    def view(self):
        return self  # its get() and `in` are all the manager reads

    def get(self, key, default=None):
        return self.holders(key) or default

    def __contains__(self, key):
        return bool(self.holders(key))

    def set_info(self, info):
        """Unregister the old id (dropping its holders) and register `info`, as the link does."""
        for holders in self.directory.holders.values():
            holders.pop(self.info.replica_id, None)
        del self.directory.infos[self.info.replica_id]
        self.info = info
        self.directory.infos[info.replica_id] = info

    def expect_step_ends(self):
        pass

    def end_step(self):
        pass

    def answers_routed(self):
        self.routed = True

    def replica(self, replica_id):
        return self.directory.infos.get(replica_id)

    def mine(self):
        return {k for k, hs in self.directory.holders.items() if self.info.replica_id in hs}

    def close(self):
        self.removed(list(self.directory.holders))


class QueriedLink(FakeLink):
    """A link that queries the Directory on a miss: its view is empty, and the test sees what it asks."""

    queried = True

    def __init__(self, directory, info):
        super().__init__(directory, info)
        self.asked = []

    @property
    def view(self):
        return {}

    def ask(self, key, shard):
        self.asked.append(key)
        return True


class PoolFetch:
    """Stands in for the NodeAgent: reads the holder's pool when the future is resolved."""

    def __init__(self, hold: bool = False, corrupt: bool = False):
        self.hold = hold
        self.corrupt = corrupt
        self.pending: list[tuple[Future, ReplicaInfo, list, list, list]] = []
        self.calls = 0
        self.rows_asked: list[list[int]] = []

    def __call__(self, info, rows, keys, gens):
        self.calls += 1
        self.rows_asked.append(list(rows))
        future: Future = Future()
        self.pending.append((future, info, rows, keys, gens))
        if not self.hold:
            self.release()
        return future

    def forget_gone(self, replica_info):
        pass

    def release(self):
        for future, info, rows, keys, gens in self.pending:
            pool = HostPool(info.pool_name, layout_of(info), create=False)
            try:
                data, metas = read_rows(pool, rows, keys, gens)
                data = np.array(data)  # the agent's result is a copy in the object store
            finally:
                pool.close()
            if self.corrupt:
                data[:, :, 0] ^= 0xFF  # the first byte of every slot
            future.set_result((data, metas))
        self.pending.clear()

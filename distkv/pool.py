"""Old path of the pool's types that cross processes pickled, kept for those pickles: a
NodeAgent's read answers each row's headers as `Sealed`s, read by the replicas of every
version during a rolling upgrade (docs/operations.md, "Rolling upgrades"); a scheduler
hands its workers `PoolLoadStoreSpec`s. New code imports them from `distkv.storage`.
"""

from distkv.storage.pool import PoolLoadStoreSpec
from distkv.storage.slots import Sealed

__all__ = ["PoolLoadStoreSpec", "Sealed"]

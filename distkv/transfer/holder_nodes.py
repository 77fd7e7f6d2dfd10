"""`HolderNodes`: the node of each holder a replica read from, for whatever it keeps per node."""

from __future__ import annotations

from collections.abc import Callable

from distkv.directory.records import ReplicaInfo


class HolderNodes:
    """The node of each holder read from, so that what is kept per node (a NodeAgent's
    handle, a measured rate) goes once the Directory lists none of its holders: they
    left, or their node died and the Directory dropped them. Otherwise such maps would
    grow with every node that ever held a block read here."""

    def __init__(self) -> None:
        self._node_of: dict[str, str] = {}  # holder replica -> its node

    def note(self, holder: ReplicaInfo) -> None:
        self._node_of[holder.replica_id] = holder.node_id

    def live(self, replica_info: Callable[[str], ReplicaInfo | None]) -> set[str]:
        """Forget the holders that `replica_info` no longer lists, or lists on another
        node; the nodes of the others."""
        for replica_id, node_id in list(self._node_of.items()):
            info = replica_info(replica_id)
            if info is None or info.node_id != node_id:
                del self._node_of[replica_id]
        return set(self._node_of.values())

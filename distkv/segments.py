"""Old path of `UntrustedSegment`, kept for pickles: a NodeAgent that refuses to open a pool
raises it, and Ray carries it to the replica that asked, of whichever version, during a
rolling upgrade (docs/operations.md, "Rolling upgrades"). New code imports it from
`distkv.storage.segments`.
"""

from distkv.storage.segments import UntrustedSegment

__all__ = ["UntrustedSegment"]

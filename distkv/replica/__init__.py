"""The replica: the managers an engine's scheduler calls, and joining a cluster.

Owns the local manager (`local_manager`: which block sits in which pool row) and its
eviction `policies`, the cluster manager (`cluster_manager`, with its parts: `inflight`
promotions, `protection` of what scans found, `placement` of blocks on Directory shards,
the cache `epochs`, what requests may `pulls`, `replica_stats`) and the `dedupe` store policy around it, the tier's
plain half (`tier`: vLLM's primary chunks through the cluster manager), the specs and plan
of distkv's seed API (`specs`, `plan`), the composition root that joins a Ray cluster
(`join`) and the stand-in engine (`harness`).

May import: everything below it (the foundation, `distkv.observability`,
`distkv.storage`, `distkv.directory`, `distkv.transfer`, `distkv.routing`). `join` alone also imports Ray
and `ray_actors`, to create the actors and hand their handles to the plain classes.
"""

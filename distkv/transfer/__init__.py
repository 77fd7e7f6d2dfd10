"""Transfer: how a block held by another replica becomes a row of this replica's pool, or
of its owner's memory (vLLM's primary chunks, for distkv's tier).

Owns promotion (`promotion`: reserve, read, check, accept), where a promotion lands
(`landing`: a pool's rows, sealed; an owner's chunks, checked), the transports that bring
another node's rows here (`transport`: the object store through a NodeAgent, NIXL
one-sided reads; `node_rates`: which is faster from each holder node; `holder_nodes`: the
nodes they keep something for), NIXL itself
(`rdma`) and the sealing of a pool's NIXL endpoint for the members of its cache
namespace (`endpoint_seal`).

May import: the foundation, `distkv.observability`, `distkv.storage`, `distkv.directory`
(the holders a promotion reads from). No Ray: a NodeAgent's reads come in as a
`transport.RemoteFetch` that whoever wires the cluster hands in.
"""

"""Storage: a replica's host pool, the slot protocol every reader of it follows, and the
copies into and out of its rows.

Owns the pool's shared-memory segments (`segments`), the pool and its slot protocol
(`pool`), and the byte movers that touch rows: `handlers/` (the engine's KV cache <-> pool,
CPU or CUDA) and `tier_copies` (vLLM's primary-tier chunks <-> pool).

May import: the foundation (`distkv.abstract`, `distkv.names`) and `distkv.observability`.
"""

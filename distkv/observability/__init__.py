"""Observability: what a replica, a shard and a node agent count, and how it is shown.

Owns the error log every component keeps (`errors`), the counts a replica reports
(`stats`), the metric definitions and their exporter to Ray (`metrics`), and `distkv
status` (`status`), which reads the Directory's shards over Ray.

May import: the foundation (`distkv.names`). Ray only inside functions that run where
Ray does (the exporter, `status`); nothing else of distkv.
"""

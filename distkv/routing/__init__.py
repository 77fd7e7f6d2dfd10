"""Where a prefix's work happens: route the request to the cache, pull where routing cannot.

Owns, as plain classes that run without Ray: the pull gate (`pull_gate`: whether a replica
pulls a run of blocks another holds or recomputes them, from the times it measured), and a
request router's rule: the prompt's block keys as each engine computes them (`keys`), the
Directory's answer as it travels with a request to the replica the router chose (`answer`),
the expected time to first token each candidate replica is scored by (`score`), the
router's decision per request (`router`) and a vLLM engine's identity as its Serve replica
reports it (`identity`). The Ray Serve adapter around it is `distkv.serve_router`; the
cluster manager (`distkv.replica`) asks the gate and reads the answer. The rule and its
constants: docs/routing.md.

May import: the foundation (`distkv.abstract`, `distkv.config`, `distkv.names`),
`distkv.observability`, `distkv.storage`'s key rules and `distkv.directory`'s records and
placement. No Ray.
"""

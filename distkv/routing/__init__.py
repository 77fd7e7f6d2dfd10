"""Routing requests to the cache: the rule, the keys and the answer a request carries.

Owns what a request router needs to know of distkv, as plain classes that run without Ray:
the prompt's block keys as each engine computes them (`keys`), the Directory's answer as it
travels with a request to the replica the router chose (`answer`), the expected time to
first token each candidate replica is scored by (`score`), and the router's decision per
request (`router`). Imports `distkv`'s Directory types and nothing of Ray; the Ray Serve
adapter around it is `distkv.serve_router`. The rule and its constants: docs/routing.md.
"""

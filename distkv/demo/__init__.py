"""`distkv demo`: a small real transformer per replica, its KV cache shared through distkv.

model: the transformer and its paged KV cache; workload: the trace and its oracle;
engine: a replica serving the trace; report: totals, checks, table; runner: the command.
"""

"""`distkv demo`: a small real transformer per replica, its KV cache shared through distkv.

model: the transformer and its paged KV cache; workload: the trace and its oracle;
arrivals: how the client sends the trace (a closed loop or an open one); engine: a replica
serving the trace; report: totals, checks, table; stuck: the stacks a stuck step prints;
handles: a DeploymentHandle that can route; runner: the command.
"""

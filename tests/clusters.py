"""Simulated multi-node Ray clusters for tests (ray.cluster_utils.Cluster on this machine)."""

import contextlib
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster

from distkv.demo.runner import token_auth_on

MB = 1024**2


@contextlib.contextmanager
def simulated_cluster(extra_nodes: int) -> Iterator[tuple[Cluster, list]]:
    """A head node (where the Directory runs) and `extra_nodes` more, each with 1 CPU and
    100 MB of object store, this process connected; yields (cluster, the added nodes)."""
    token_auth_on()
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 100 * MB, "include_dashboard": False},
    )
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=100 * MB) for _ in range(extra_nodes)]
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()

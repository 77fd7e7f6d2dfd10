"""The fault suite: one simulated cluster per module, and the short or long version.

CI runs the short version. `pytest tests/faults --long` or DISTKV_FAULTS_LONG=1 runs the
long one: the Directory stalled for 15 s, more kills, longer runs.
"""

import os

import pytest
from clusters import simulated_cluster

from distkv.demo.runner import token_auth_on


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False, help="run the long fault suite (also DISTKV_FAULTS_LONG=1)")


@pytest.fixture(scope="session")
def long_run(request) -> bool:
    return request.config.getoption("--long", default=False) or os.environ.get("DISTKV_FAULTS_LONG") == "1"


@pytest.fixture(scope="module")
def cluster():
    """A head node (the Directory) and three nodes for replicas; the last may be removed.
    Token authentication on, as in every cluster distkv starts."""
    token_auth_on()
    with simulated_cluster(extra_nodes=3) as (cluster, nodes):
        yield cluster, nodes

"""Each integration module gets the session's Ray cluster with clean pools: `cluster` ends
the module by killing every pool registry it left (registries are detached, named actors
that keep their settings), so the next module's workers register afresh and its leases see
only its own workers."""

import pytest
from _ray import forget_pools


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield
    forget_pools()

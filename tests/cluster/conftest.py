"""A local Ray cluster on loopback for the distributed-execution tests (one per test module)."""

from __future__ import annotations

import pytest

from tests.serve.cluster import LOOPBACK, OBJECT_STORE_BYTES


@pytest.fixture(scope="module")
def local_ray():
    """A fresh single-node Ray on 127.0.0.1 with this test process as its driver; shut down after the module."""
    import ray

    # address="local": always a new cluster, even where /tmp/ray/ray_current_cluster names one (a head
    # another test stopped by process id leaves that file behind, and ray.init would try to join it).
    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()

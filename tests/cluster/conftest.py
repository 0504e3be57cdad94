"""A local Ray cluster on loopback for the distributed-execution tests (one per test module)."""

from __future__ import annotations

import pytest

from tests.serve.cluster import LOOPBACK, OBJECT_STORE_BYTES


@pytest.fixture(scope="module")
def local_ray():
    """A fresh single-node Ray on 127.0.0.1 with this test process as its driver; shut down after the module."""
    import ray

    ray.init(_node_ip_address=LOOPBACK, num_cpus=2, object_store_memory=OBJECT_STORE_BYTES,
             include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()

"""A real local Ray cluster for the serving tests, started the way `make serve` starts it.

``ray_head``: a Ray head bound to 127.0.0.1, the test process connected to it
as a driver; Serve and Ray are stopped at the end of the session.
"""

from __future__ import annotations

import os
import time

import pytest

from serval.launcher import lifecycle as launcher
from serval.launcher.head import free_port
from tests.serve.cluster import LOOPBACK, OBJECT_STORE_BYTES, RayHead, listening_addresses
from tests.serve.haproxy_log import HAProxyLog


@pytest.fixture(scope="session")
def ray_head():
    import ray

    head = RayHead(free_port(), free_port(), free_port(), free_port(), listening_addresses(), HAProxyLog())
    os.environ["RAY_SERVE_HAPROXY_LOG_TARGET"] = head.haproxy_log.target  # read once, as the head starts
    try:
        launcher.start_ray_head(
            head.gcs_port,
            head.dashboard_port,
            num_cpus=2,
            object_store_bytes=OBJECT_STORE_BYTES,
            metrics_export_port=head.metrics_port,
        )
    finally:
        del os.environ["RAY_SERVE_HAPROXY_LOG_TARGET"]
    deadline = time.monotonic() + 60
    while not launcher.is_dashboard_up(head.dashboard_port):
        assert time.monotonic() < deadline, "the Ray dashboard did not come up"
        time.sleep(0.5)
    ray.init(
        address=f"{LOOPBACK}:{head.gcs_port}", _node_ip_address=LOOPBACK, logging_level="warning", log_to_driver=False
    )
    try:
        yield head
    finally:
        ray.shutdown()
        launcher.stop_cluster(head.dashboard_port)
        head.haproxy_log.close()

"""A Ray head on loopback for one test module, started as `make serve` starts it (``serval.launcher``),
and stopped alone: ``ray stop`` would end every Ray cluster on the machine, other people's too.

No driver joins it: the tests deploy through the dashboard's REST API and talk HTTP to Serve.
"""

from __future__ import annotations

import time

from serval.launcher import lifecycle as launcher
from serval.launcher import processes as ray_processes
from serval.launcher.head import free_port
from tests.serve.cluster import OBJECT_STORE_BYTES, RayHead, listening_addresses

DASHBOARD_START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def start_head(num_cpus: int = 2) -> RayHead:
    head = RayHead(free_port(), free_port(), free_port(), free_port(), listening_addresses())
    launcher.start_ray_head(
        head.gcs_port,
        head.dashboard_port,
        num_cpus=num_cpus,
        object_store_bytes=OBJECT_STORE_BYTES,
        metrics_export_port=head.metrics_port,
    )
    deadline = time.monotonic() + DASHBOARD_START_TIMEOUT_S
    while not launcher.is_dashboard_up(head.dashboard_port):
        if time.monotonic() > deadline:
            stop_head(head)
            raise TimeoutError("the Ray dashboard did not come up")
        time.sleep(0.5)
    return head


def stop_head(head: RayHead) -> None:
    """Ends the head's processes by id (``serval.launcher.processes``, what ``make stop`` uses): SIGTERM,
    then SIGKILL for those left after ``STOP_GRACE_S``."""
    ray_processes.stop_head(head.gcs_port, grace_s=STOP_GRACE_S)

"""The flags that name the Ray cluster, shared by ``serval serve``, ``serval status`` and ``serval stop``
(no Ray import here: ``serval --help`` stays fast)."""

from __future__ import annotations

import argparse

DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_GCS_PORT = 6379


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the Ray cluster")
    group.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster to use: its dashboard (http://HOST:8265) or GCS address (HOST:6379); "
        "default: RAY_ADDRESS, else the head on 127.0.0.1 at --dashboard-port (serval serve starts one)",
    )
    group.add_argument(
        "--dashboard-port", type=int, default=DEFAULT_DASHBOARD_PORT, help="the local head's dashboard port"
    )
    group.add_argument("--gcs-port", type=int, default=DEFAULT_GCS_PORT, help="the local head's GCS port")

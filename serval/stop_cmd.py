"""``serval stop``: ends what ``serval serve --detach`` (or ``make serve``) left running.

On the local head (no ``--address`` / ``RAY_ADDRESS``): its in-flight HTTP streams finish, Serve shuts
down and the head's processes stop, by id (other Ray clusters on the machine are left alone). On a cluster
named by ``--address`` / ``RAY_ADDRESS``: only the applications (``--app``, default: all of them) are
deleted, each replica draining first; the cluster stays up.
"""

from __future__ import annotations

import argparse
import sys

from serval.launcher.options import add_cluster_arguments

SUMMARY = "stop what serval serve --detach started: the local head, or the apps on a cluster it joined"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--app", action="append", help="on a joined cluster: the app to delete (repeatable)")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0, help="how long in-flight streams may take")


def run(args: argparse.Namespace) -> int:
    from serval.launcher import lifecycle, serve_client

    dashboard = lifecycle.cluster_address(args.address)
    if dashboard is None:
        return 0 if lifecycle.stop_cluster(args.dashboard_port, args.gcs_port, args.drain_timeout_s) else 1
    try:
        names = args.app or list(serve_client.instance_details(dashboard).applications)
        serve_client.delete_apps(names, dashboard, timeout_s=args.drain_timeout_s)
    except (ConnectionError, RuntimeError) as error:
        print(f"serval stop: {error}", file=sys.stderr)
        return 1
    print(f"Deleted {', '.join(names) or 'no apps'}; the Ray cluster at {dashboard} stays up.")
    return 0

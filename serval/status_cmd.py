"""``serval status``: what runs on the Ray cluster ``serval serve`` uses (``serve status``, in Serval's words).

Each application with its status, route and endpoint, each deployment with its replicas' states and,
when one is stuck, Serve's reason (unschedulable resources, a failing constructor) and what the cluster
has not placed yet (pending placement groups and actors, what they ask for, what is free); for a cluster
on this machine, the native CPU kernels' state (built, building for how long, not built). Exit status 0 when
every application is RUNNING, 1 when none runs or the cluster does not answer, 3 while any is not RUNNING.
"""

from __future__ import annotations

import argparse
import sys

from serval.launcher.options import add_cluster_arguments

SUMMARY = "show the Serve applications on the cluster and why any is not RUNNING (serve status)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from serval.launcher import lifecycle, pending, serve_client, status
    from serval.launcher.kernels import KernelBuild

    elsewhere = lifecycle.cluster_address(args.address)
    dashboard = elsewhere or lifecycle.dashboard_url(args.dashboard_port)
    try:
        details = serve_client.instance_details(dashboard)
    except (ConnectionError, RuntimeError) as error:
        print(f"No Ray cluster answers at {dashboard} ({error}).", file=sys.stderr)
        return 1
    print(f"Ray cluster: {dashboard}")
    if line := KernelBuild.observe(local=elsewhere is None).status_line():
        print(line)
    if not details.applications:
        print("No Serve application runs there (serval serve starts one).")
        return 1
    print("\n".join(status.status_lines(details)))
    if status.is_running(details, list(details.applications)):
        return 0
    waiting = pending.Pending.fetch(dashboard)
    for line in pending.lines(waiting):
        print(line)
    if reason := pending.infeasible_reason(waiting, list(details.applications)):
        print(reason)
    return 3

"""What the cluster has not placed yet, and why: pending placement groups and actors with what they ask for,
beside the cluster's free resources (Ray's state API and the autoscaler's report, what ``ray status`` and
``ray list placement-groups`` print).

``Pending.fetch`` asks the dashboard; the rest are pure functions of its answer:

- ``lines``: one line per pending placement group (a Serve replica's is named after the replica) and per
  pending actor, then the cluster's free resources: shown while a deploy waits and by ``serval status``.
- ``infeasible_reason``: why a replica of the given apps can never be placed (Ray found no node that can
  hold one of its bundles), or None: final on a cluster that does not grow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"  # Serve names a replica's placement group after the replica
STATE_API_TIMEOUT_S = 10
# A resource of a placement group's bundle as Ray names it: <resource>_group_[<bundle index>_]<group id>.
_GROUP_RESOURCE = re.compile(r"^(?P<name>.+?)_group_(?:(?P<index>\d+)_)?[0-9a-f]{36}$")
# The autoscaler's usage report names resources in camel case: placement groups' (CPUGroup0<id>) are left out.
_SHOWN_USAGE = re.compile(r"^(?!node:|objectStoreMemory|bundleGroup|.*Group[0-9A-Fa-f]*$)")


@dataclass(frozen=True)
class Pending:
    """``groups``: pending placement groups (``PlacementGroupState``); ``actors``: actors pending creation
    (``ActorState``); ``usage``: resource -> (used, total) over the cluster."""

    groups: list[Any] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    usage: dict[str, tuple[float, float]] = field(default_factory=dict)
    nodes: list[dict[str, float]] = field(default_factory=list)  # each live node's total resources

    @classmethod
    def fetch(cls, dashboard: str) -> Pending:
        """The cluster's pending work at ``dashboard``; empty when it cannot say. Two state API calls when
        nothing is pending; the resources are asked for only when something is (a deploy polls this)."""
        from ray.util.state import list_actors, list_placement_groups

        from serval.launcher.serve_client import cluster_nodes, cluster_usage

        try:
            groups = list_placement_groups(
                address=dashboard, filters=[("state", "=", "PENDING")], detail=True, timeout=STATE_API_TIMEOUT_S
            )
            actors = list_actors(
                address=dashboard,
                filters=[("state", "=", "PENDING_CREATION")],
                detail=True,
                timeout=STATE_API_TIMEOUT_S,
            )
        except Exception:  # noqa: BLE001 -- the state API raises several kinds; no answer means nothing to say
            return cls()
        if not groups and not actors:
            return cls()
        infeasible = any(_scheduling_state(group) == "INFEASIBLE" for group in groups)
        return cls(list(groups), list(actors), cluster_usage(dashboard), cluster_nodes(dashboard) if infeasible else [])

    def free(self) -> dict[str, float]:
        return {name: total - used for name, (used, total) in self.usage.items()}


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """``resources`` in a bundle's own names: Ray's ``CPU_group_<i>_<group id>`` is ``CPU``; its wildcard
    (``CPU_group_<group id>``) and bookkeeping (``bundle_group_*``, ``node:*``) entries go."""
    plain = {}
    for name, amount in resources.items():
        match = _GROUP_RESOURCE.match(name)
        if match is None and not name.startswith("node:"):
            plain[name] = amount
        elif match is not None and match["index"] is not None and match["name"] != "bundle":
            plain[match["name"]] = amount
    return plain


def _amounts(resources: dict[str, float]) -> str:
    shown = dict(sorted(_plain(resources).items()))
    return "{" + ", ".join(f"{name}: {_number(name, amount)}" for name, amount in shown.items()) + "}"


def _number(name: str, amount: float) -> str:
    if name in ("memory", "object_store_memory", "objectStoreMemory"):
        return f"{amount / 2**30:.2f} GiB"
    return f"{amount:g}"


def _group_name(group: Any) -> str:
    return group.name.removeprefix(SERVE_REPLICA_PREFIX) if group.name else group.placement_group_id[:12]


def _actor_name(actor: Any) -> str:
    if actor.name.startswith(SERVE_REPLICA_PREFIX):
        return f"replica {actor.name.removeprefix(SERVE_REPLICA_PREFIX)}"
    return f"actor {actor.class_name} {actor.name or actor.actor_id[:12]}"


def _bundles(group: Any) -> list[dict[str, float]]:
    return [bundle["unit_resources"] for bundle in group.bundles]


def _scheduling_state(group: Any) -> str:
    return str((group.stats or {}).get("scheduling_state", "PENDING"))


def lines(pending: Pending) -> list[str]:
    """Each pending placement group and actor with what it asks for, then the cluster's free resources."""
    found = [
        f"placement group {_group_name(group)}: bundles "
        f"[{', '.join(map(_amounts, _bundles(group)))}], {_scheduling_state(group)}"
        for group in pending.groups
    ]
    found += [
        f"{_actor_name(actor)}: asks for {_amounts(actor.required_resources or {})}"
        + (" in its placement group" if actor.placement_group_id else "")
        for actor in pending.actors
    ]
    if not found:
        return []
    usage = ", ".join(
        f"{_number(name, total - used)} of {_number(name, total)} {name}"
        for name, (used, total) in sorted(pending.usage.items())
        if _SHOWN_USAGE.match(name)
    )
    return ["Pending on the cluster:", *(f"  {line}" for line in found), f"  free: {usage or 'unknown'}"]


def infeasible_reason(pending: Pending, app_names: list[str]) -> str | None:
    """Why a replica of ``app_names`` can never be placed (Ray marks its placement group INFEASIBLE: no node
    can hold one of its bundles), naming its bundles and the cluster's resources; None otherwise."""
    for group in pending.groups:
        name = _group_name(group)
        if _scheduling_state(group) != "INFEASIBLE" or not any(name.startswith(f"{app}#") for app in app_names):
            continue
        largest = {kind: max(node.get(kind, 0.0) for node in pending.nodes) for node in pending.nodes for kind in node}
        return (
            f"The placement group of replica {name} asks for bundles "
            f"[{', '.join(map(_amounts, _bundles(group)))}], and no node of the cluster can hold one of them "
            f"(the most any node has: {_amounts(largest)}). A replica's bundle 0 holds its ray_actor_options' "
            "resources and its first engine worker's (placement_group_config's bundles[0]): make the bundles "
            "smaller, or add nodes that have what they ask for."
        )
    return None

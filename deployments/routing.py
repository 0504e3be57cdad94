"""``KVAwareRouter``: a Ray Serve request router that sends each request to the LLM-server replica whose
prefix cache holds most of its prompt, unless that replica is too busy, and keeps sessions together.

Chosen per deployment with Serve's own mechanism, in an LLM config::

    deployment_config:
      request_router_config:
        request_router_class: deployments.routing:KVAwareRouter
        request_router_kwargs: {prefix_weight: 3, load_weight: 2}   # deployments.kv_index.KVRouterOptions
        request_routing_stats_period_s: 0.5

The ingress (``deployments.ingress.RayModelRouter``) tokenizes the prompt and
passes a ``RoutingHint`` (token ids, cache salt, ``x-session-id``) as the
``routing_hint`` keyword of ``LLMServer.call``. The router hashes the
prompt's leading full blocks with the engine's own code and scores the
replicas (``deployments.kv_index``). Replicas publish their load and their
block pool's stored / removed events through Serve's routing-stats poll
(``LLMServer.record_routing_stats``): the controller polls each replica
every ``request_routing_stats_period_s`` and broadcasts changes to every
handle's router, with no extra actor call or connection of our own; its
delay (a period plus the controller's broadcast) is covered by the router
recording the blocks of each prompt it sends at once (``KVIndex.predict``).

Multi-LoRA: the hint names the request's adapter, whose name keys its
blocks, and a request with a ``multiplexed_model_id`` goes first to the
replicas that report holding that adapter, then to those holding the fewest
(``deployments.kv_index.adapter_tiers``, Serve's multiplexing order); the
prefix and load scores rank the replicas within each of those tiers.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.kv_index import (
    Choice,
    KVIndex,
    KVRouterOptions,
    RoutingHint,
    adapter_tiers,
    choose,
    prompt_block_hashes,
)
from deployments.llm_config import SERVER_NAME_PREFIX
from deployments.metrics import RouterMetrics

logger = logging.getLogger("ray.serve")

ROUTING_HINT_KWARG = "routing_hint"
MAX_REMEMBERED_CHOICES = 4096  # choices of requests whose routing never finished (cancelled) are dropped past this


def routing_hint_of(pending_request: PendingRequest | None) -> RoutingHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get(ROUTING_HINT_KWARG)
    return hint if isinstance(hint, RoutingHint) else None


class KVAwareRouter(RequestRouter):
    """Ranks the live replicas by cached prefix and load (``deployments.kv_index.choose``); Serve then
    sends the request to the first of them that has room (``max_ongoing_requests``)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``kwargs``: ``KVRouterOptions`` (refused if unknown; ``LLMConfig`` refuses them at deploy time)."""
        self.options = KVRouterOptions.model_validate(kwargs)
        self.index = KVIndex()
        self.metrics = RouterMetrics(self._deployment_id.name.removeprefix(SERVER_NAME_PREFIX))
        self._choices: dict[str, Choice] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = routing_hint_of(pending_request)
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if hint is None and not adapter:  # control calls (stats, health, ...): least queued of a shuffle
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        held = {replica_id: replica.multiplexed_model_ids for replica_id, replica in by_id.items()}
        for replica in candidate_replicas:
            self.index.replica(replica.replica_id.unique_id).ongoing = self.replica_queue_len_cache.get(
                replica.replica_id
            )
        request_id = pending_request.metadata.internal_request_id  # a hint comes with a request
        earlier = self._choices.get(request_id)  # a retry: the prompt is hashed already
        start = time.perf_counter()
        tiers = adapter_tiers(list(by_id), held, adapter)
        choice = choose(self.options, self.index, list(by_id), hint, earlier and earlier.hashes, tiers)
        if choice.ranked:
            self.metrics.record_routing_time(choice.ranked[0], time.perf_counter() - start)
        if len(self._choices) >= MAX_REMEMBERED_CHOICES:
            self._choices.clear()
        self._choices[request_id] = choice
        # One replica per rank: Serve picks the lowest queue within a rank, which would undo the order.
        return [[by_id[replica_id]] for replica_id in choice.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        replica = replica_id.unique_id
        view = self.index.replica(replica)
        view.in_flight += 1
        choice = self._choices.pop(pending_request.metadata.internal_request_id, None)
        hint = routing_hint_of(pending_request)
        reason = "load"
        if hint is not None and hint.prompt_token_ids:
            hashes = choice.hashes if choice is not None else prompt_block_hashes(self.options, hint)
            predicted = view.matched_blocks(hashes)
            self.index.predict(replica, hashes)
            self.metrics.record_prompt(replica, len(hint.prompt_token_ids), predicted * self.options.block_size)
            reason = choice.reason if choice is not None and choice.ranked[:1] == [replica] else "fallback"
        self.metrics.record_decision(replica, reason, view.load)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        view = self.index.replicas.get(replica_id.unique_id)
        if view is not None and view.in_flight > 0:
            view.in_flight -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new view of the replicas (and their latest routing stats): the index follows it."""
        super().update_replicas(replicas)
        for replica in replicas:
            stats = replica.routing_stats
            if stats:
                self.index.publish(replica.replica_id.unique_id, stats)
        self.index.retain({replica.replica_id.unique_id for replica in replicas})
        self.metrics.record_index(self.index)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.replicas.pop(replica_id.unique_id, None)

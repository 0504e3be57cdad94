"""The KV-aware router's state and policy, without Ray: its options, the per-replica index of cached
blocks, the scores, and session affinity.

A replica publishes (``LLMServer.record_routing_stats``) its load and its
latest KV event batches, each numbered; ``KVIndex.publish`` applies the
batches it has not seen, in order. A lost batch (a gap in the numbers) is
applied past: the index may then claim a block the replica evicted, or miss
one it holds, until the replica's next full snapshot (``engine.sched.kv_events``)
resynchronises it. Either costs a cache miss or a missed hit, never a wrong
answer: the engine looks up its own cache. The router also records the
blocks of each prompt it sends (``predict``), so its own decisions count
before the replica reports them.

A LoRA adapter's prompt is hashed with the adapter's name, as its replica's
engine keys that adapter's blocks (``engine.sched.block_hash.lora_hash_key``),
so it is predicted to hit only that adapter's blocks. A request for an
adapter (Serve's ``multiplexed_model_id``) goes first to the replicas that
hold it, as Serve's own routers send it (``adapter_tiers``); the prefix and
load scores order the replicas within each tier.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sched.block_hash import BlockHash, extend_block_hashes, get_hash_function, lora_hash_key
from engine.sched.kv_events import KVEventBatch

# How many numbered batches a replica repeats in each publication: a router that misses up to
# this many minus one polls in a row still sees every batch.
PUBLISHED_BATCHES = 4


class KVRouterOptions(BaseModel):
    """``request_router_kwargs`` of ``deployments.routing:KVAwareRouter``; unknown keys are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix_weight: float = Field(3.0, ge=0, description="Weight of the fraction of leading blocks a replica holds.")
    load_weight: float = Field(2.0, ge=0, description="Weight of how lightly loaded a replica is (llm-d's 3 : 2).")
    session_max_extra_load: int = Field(
        8, ge=0, description="A session leaves its replica once it has this many more requests than the least loaded."
    )
    block_size: int = Field(16, ge=1, description="The engine's KV block size (LLMConfig fills it in).")
    hash_algo: Literal["sha256", "blake2b"] = Field("sha256", description="The engine's prefix-caching hash.")


@dataclass
class RoutingHint:
    """What the ingress tells the router about one request; the replica serves its prompt from it
    (``deployments.routing_hints.precomputed_prompt``) instead of tokenizing it again.

    ``prompt_token_ids``: the first prompt's tokens; ``prompt_text``: for chat, the rendered conversation they
    are the tokens of (None for completions); ``lora_name``: the LoRA adapter the request names (None: the base
    model), whose name keys its blocks.
    """

    prompt_token_ids: list[int] | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    prompt_text: str | None = None
    lora_name: str | None = None


def prompt_block_hashes(options: KVRouterOptions, hint: RoutingHint) -> list[BlockHash]:
    """The engine's chained hashes of the prompt's leading full blocks that a cache hit can cover
    (never the block holding the last token: the engine computes it), keyed by its salt and adapter."""
    token_ids = hint.prompt_token_ids or []
    num_blocks = max(0, len(token_ids) - 1) // options.block_size
    hashes: list[BlockHash] = []
    extend_block_hashes(
        get_hash_function(options.hash_algo),
        hashes,
        token_ids[: num_blocks * options.block_size],
        options.block_size,
        hint.cache_salt,
        lora_hash_key(hint.lora_name),
    )
    return hashes


@dataclass
class ReplicaKV:
    """What the router believes one replica holds, and its load."""

    held: set[BlockHash] = field(default_factory=set)
    last_seq: int = 0
    ongoing: int | None = None  # Serve's count of its ongoing requests (probed, kept by sends and completions)
    reported_load: int = 0  # its engine's running + waiting, as of its last publication (a period old)
    in_flight: int = 0  # requests this router sent that have not completed
    lost_batches: int = 0

    @property
    def load(self) -> int:
        """Its requests running or waiting: Serve's fresh count when it has one (a publication is up to a
        period old, and a stale high count would repel traffic from a replica already idle)."""
        if self.ongoing is not None:
            return self.ongoing
        return max(self.reported_load, self.in_flight)

    def matched_blocks(self, hashes: list[BlockHash]) -> int:
        """How many of ``hashes`` (a chain) it holds from the start."""
        for index, block_hash in enumerate(hashes):
            if block_hash not in self.held:
                return index
        return len(hashes)


class KVIndex:
    """Per-replica views, keyed by replica id; replicas not in ``retain`` are forgotten."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaKV] = {}

    def replica(self, replica_id: str) -> ReplicaKV:
        return self.replicas.setdefault(replica_id, ReplicaKV())

    def retain(self, live_replica_ids: set[str]) -> None:
        for replica_id in list(self.replicas):
            if replica_id not in live_replica_ids:
                del self.replicas[replica_id]

    def publish(self, replica_id: str, stats: dict) -> None:
        """Applies a replica's publication (``publication`` below); stale or repeated batches are skipped."""
        replica = self.replica(replica_id)
        replica.reported_load = stats.get("num_running", 0) + stats.get("num_waiting", 0)
        for seq, batch in stats.get("kv_batches", ()):
            if seq <= replica.last_seq:
                continue
            if seq > replica.last_seq + 1 and not batch.cleared:
                replica.lost_batches += seq - replica.last_seq - 1
            batch.apply_to(replica.held)
            replica.last_seq = seq

    def predict(self, replica_id: str, hashes: list[BlockHash]) -> None:
        """Records that the replica is about to cache ``hashes`` (a request was routed there)."""
        self.replica(replica_id).held.update(hashes)


def publication(batches: list[tuple[int, KVEventBatch]], num_running: int, num_waiting: int) -> dict:
    """A replica's routing stats: its load and its last numbered KV batches (what ``KVIndex.publish`` reads)."""
    return {"num_running": num_running, "num_waiting": num_waiting, "kv_batches": list(batches)}


@dataclass
class Choice:
    """The replicas ranked best first, why the first won, the blocks it was predicted to hold, and the
    prompt's block hashes (computed once per request)."""

    ranked: list[str]
    reason: Literal["prefix", "load", "session"]
    predicted_blocks: int
    hashes: list[BlockHash] = field(default_factory=list)


def rank_replicas(options: KVRouterOptions, index: KVIndex, candidates: list[str], hashes: list[BlockHash]) -> Choice:
    """Scores each candidate: ``prefix_weight`` x the fraction of the prompt's blocks it holds plus
    ``load_weight`` x (1 - its load / the largest load among them); ties broken at random."""
    views = [index.replica(replica_id) for replica_id in candidates]
    matched = [view.matched_blocks(hashes) for view in views]
    max_load = max((view.load for view in views), default=0)
    scores = {}
    for replica_id, view, num_matched in zip(candidates, views, matched):
        prefix_score = num_matched / len(hashes) if hashes else 0.0
        load_score = 1.0 - view.load / max_load if max_load else 1.0
        scores[replica_id] = options.prefix_weight * prefix_score + options.load_weight * load_score
    shuffled = random.sample(candidates, len(candidates))
    ranked = sorted(shuffled, key=lambda replica_id: -scores[replica_id])
    best_matched = matched[candidates.index(ranked[0])] if ranked else 0
    return Choice(ranked, "prefix" if best_matched else "load", best_matched, hashes)


def session_replica(session_id: str, candidates: list[str]) -> str:
    """The session's replica by rendezvous hashing: stable while it stays a candidate, and only the
    sessions of a replica that goes away move."""
    return max(candidates, key=lambda replica_id: hashlib.blake2b(f"{session_id}/{replica_id}".encode()).digest())


def adapter_tiers(
    candidates: list[str], held_models: Mapping[str, Collection[str]], multiplexed_model_id: str | None
) -> list[list[str]]:
    """Serve's multiplexing preference (``MultiplexMixin.rank_replicas_via_multiplex``) over ``candidates``:
    the replicas holding ``multiplexed_model_id`` (``held_models``: each replica's), then those of the rest
    holding the fewest models (a new adapter goes where it evicts least), then the others; empty tiers left
    out. One tier of all without a multiplexed model id."""
    if not multiplexed_model_id:
        return [candidates]
    holding = [replica_id for replica_id in candidates if multiplexed_model_id in held_models.get(replica_id, ())]
    rest = [replica_id for replica_id in candidates if replica_id not in holding]
    fewest = min((len(held_models.get(replica_id, ())) for replica_id in rest), default=0)
    lightest = [replica_id for replica_id in rest if len(held_models.get(replica_id, ())) == fewest]
    others = [replica_id for replica_id in rest if replica_id not in lightest]
    return [tier for tier in (holding, lightest, others) if tier]


def choose_in_tier(
    options: KVRouterOptions, index: KVIndex, candidates: list[str], hint: RoutingHint | None, hashes: list[BlockHash]
) -> Choice:
    """Session affinity first (while its replica is within ``session_max_extra_load`` of the least
    loaded), else ``rank_replicas``."""
    choice = rank_replicas(options, index, candidates, hashes)
    if hint is None or hint.session_id is None or not candidates:
        return choice
    sticky = session_replica(hint.session_id, candidates)
    least_load = min(index.replica(replica_id).load for replica_id in candidates)
    if index.replica(sticky).load > least_load + options.session_max_extra_load:
        return choice
    others = [replica_id for replica_id in choice.ranked if replica_id != sticky]
    return Choice([sticky, *others], "session", index.replica(sticky).matched_blocks(hashes), hashes)


def choose(
    options: KVRouterOptions,
    index: KVIndex,
    candidates: list[str],
    hint: RoutingHint | None,
    hashes: list[BlockHash] | None = None,
    tiers: list[list[str]] | None = None,
) -> Choice:
    """The replicas ranked: each tier of ``tiers`` (``adapter_tiers``; default: ``candidates`` as one) by
    ``choose_in_tier``, tier after tier; the reason and predicted blocks are the first tier's.
    ``hashes``: the prompt's, if already computed (a retry)."""
    if hashes is None:
        hashes = prompt_block_hashes(options, hint) if hint is not None and hint.prompt_token_ids else []
    first, *later = [choose_in_tier(options, index, tier, hint, hashes) for tier in tiers or [candidates]]
    first.ranked += [replica_id for choice in later for replica_id in choice.ranked]
    return first

"""The scheduler side of KV transfer between a prefill engine and a decode engine (vLLM's KV connector).

Disaggregated serving runs a prompt twice over two engines:

* the **producer** (prefill engine) computes the prompt's KV and the first token
  for a request whose ``kv_transfer_params`` say ``do_remote_decode``. Right after
  the step that completes the prompt, its worker copies the request's KV blocks
  out to the transport (``KVSave``) and returns an opaque, picklable handle;
  the request finishes with ``kv_transfer_params = {"remote_kv": KVHandle}``.
  The copy means the producer frees its blocks at once, as for any finished
  request: nothing on the prefill side waits on the decode side.
* the **consumer** (decode engine) gets the same prompt with
  ``kv_transfer_params = {"remote_kv": KVHandle}``. When it admits the request it
  first takes its own prefix-cache hits, then asks this connector how many more
  tokens can be loaded (``get_num_new_matched_tokens``): the handle's blocks past
  the local hits, never the prompt's last token (the decode engine recomputes it
  and samples the first token itself, so sampling stays entirely on one side).
  The step that admits it carries a ``KVLoad`` (which of the handle's blocks go
  into which local blocks); the worker loads them before the forward. Blocks the
  decode side already held are never transferred.

The connector is transport-agnostic: it only counts blocks and passes handles
through. Workers implement the transfer (``engine/kv_transfer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.sched.kv_cache_groups import FULL_ATTENTION, KVCacheGroup
from engine.sched.request import Request

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


@dataclass(frozen=True)
class KVHandle:
    """Where a request's prompt KV went: ``num_blocks`` blocks of ``block_size`` tokens covering
    ``num_tokens`` prompt tokens. ``data`` is the transport's own (picklable) reference."""

    data: Any
    num_tokens: int
    num_blocks: int
    block_size: int
    num_bytes: int


@dataclass
class KVSave:
    """After this step's forward, copy ``block_ids`` (the request's whole prompt) out to the transport."""

    req_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVLoad:
    """Before this step's forward, load ``src_block_indices`` of ``handle`` into local ``dst_block_ids``."""

    req_id: str
    handle: KVHandle
    src_block_indices: list[int]
    dst_block_ids: list[int]


@dataclass
class KVConnectorMetadata:
    """One step's transfer plan (part of the SchedulerOutput)."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class KVTransferOutput:
    """What a worker reports about one step's transfers (part of the ModelRunnerOutput)."""

    saved: dict[str, KVHandle] = field(default_factory=dict)
    num_loaded_bytes: int = 0
    load_latencies_s: list[float] = field(default_factory=list)
    failed_load_req_ids: list[str] = field(default_factory=list)  # recomputed locally instead


@dataclass
class KVTransferStats:
    """Totals since start; ``num_skipped_blocks``: remote blocks not loaded because the decode side held them."""

    num_saves: int = 0
    num_saved_bytes: int = 0
    num_loads: int = 0
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    num_skipped_blocks: int = 0
    num_failed_loads: int = 0


class KVConnectorScheduler:
    """Decides, per request, what the workers save and load; see the module docstring."""

    def __init__(
        self, role: KVRole, block_size: int, kv_cache_groups: tuple[KVCacheGroup, ...] = FULL_ATTENTION
    ) -> None:
        if tuple(group.window for group in kv_cache_groups) != (None,):
            raise ValueError(
                "KV transfer moves one block table of full attention, not a sliding-window model's "
                f"({len(kv_cache_groups)} KV cache groups, windows {[group.window for group in kv_cache_groups]})"
            )
        self.role = role
        self.block_size = block_size
        self._pending_loads: list[KVLoad] = []
        self._pending_saves: dict[str, Request] = {}  # admitted producer requests, until their prompt is done
        self._handles: dict[str, KVHandle] = {}  # saved, until the request finishes
        self.stats = KVTransferStats()
        self._load_latencies_s: list[float] = []

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (block-aligned local hits) that the request's remote KV holds.

        Zero unless the request carries a handle it has not loaded yet, with
        the same block size. Covers whole blocks of the handle, but never the
        prompt's last token.
        """
        handle = self._remote_handle(request)
        if handle is None or num_computed_tokens % self.block_size:
            return 0
        num_loadable = min(handle.num_tokens, request.num_prompt_tokens - 1)
        return max(0, num_loadable - num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_local_tokens: int, num_external_tokens: int
    ) -> None:
        """Plans the load of the external tokens into the blocks just allocated for them (or the
        save of a producer request's prompt). The handle is used once: a preempted request recomputes."""
        if self.is_producer and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._pending_saves[request.request_id] = request
        if num_external_tokens == 0:
            return
        handle = request.kv_transfer_params.pop("remote_kv")
        first = num_local_tokens // self.block_size
        last = -(-(num_local_tokens + num_external_tokens) // self.block_size)
        self._pending_loads.append(KVLoad(request.request_id, handle, list(range(first, last)), block_ids[first:last]))
        self.stats.num_skipped_blocks += first
        self.stats.num_loads += 1
        self.stats.num_loaded_blocks += last - first

    def build_connector_meta(self, num_scheduled_tokens: dict[str, int], block_ids_of) -> KVConnectorMetadata:
        """This step's loads, and the saves of producer requests whose prompt this step completes.

        Call after the scheduler advanced ``num_computed_tokens`` past this step.
        """
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id, request in list(self._pending_saves.items()):
            if req_id in num_scheduled_tokens and request.num_computed_tokens >= request.num_prompt_tokens:
                meta.saves.append(KVSave(req_id, block_ids_of(req_id), request.num_prompt_tokens))
                del self._pending_saves[req_id]
        return meta

    def update_connector_output(self, output: KVTransferOutput | None, live_req_ids) -> None:
        """Takes the worker's report of a step: the handles saved, the bytes loaded and how long it took.

        Handles of requests no longer in ``live_req_ids`` (aborted while the step ran) are dropped here:
        kept, they would hold the saved blocks (object references) forever.
        """
        if output is None:
            return
        self._handles.update({req_id: handle for req_id, handle in output.saved.items() if req_id in live_req_ids})
        self.stats.num_saves += len(output.saved)
        self.stats.num_saved_bytes += sum(handle.num_bytes for handle in output.saved.values())
        self.stats.num_loaded_bytes += output.num_loaded_bytes
        self.stats.num_failed_loads += len(output.failed_load_req_ids)
        self._load_latencies_s.extend(output.load_latencies_s)

    def request_finished(self, request: Request) -> dict | None:
        """The ``kv_transfer_params`` the finished request returns: its saved handle, if any."""
        self._pending_saves.pop(request.request_id, None)
        handle = self._handles.pop(request.request_id, None)
        return None if handle is None else {"remote_kv": handle}

    def preempted(self, request: Request) -> None:
        """A preempted producer request is saved again when its recomputed prompt completes."""
        self._handles.pop(request.request_id, None)

    def take_load_latencies(self) -> list[float]:
        """Per-load transfer latencies since the last call (for the latency histogram)."""
        latencies, self._load_latencies_s = self._load_latencies_s, []
        return latencies

    def _remote_handle(self, request: Request) -> KVHandle | None:
        if not self.is_consumer or not request.kv_transfer_params:
            return None
        if request.sampling_params.prompt_logprobs is not None:
            return None  # every prompt position's logits are needed: compute them here
        handle = request.kv_transfer_params.get("remote_kv")
        if not isinstance(handle, KVHandle) or handle.block_size != self.block_size:
            return None
        return handle

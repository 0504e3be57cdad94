"""The worker's adapters: device slots, a host LRU, and each step's token-to-slot mapping.

``LoRAManager(model, lora_config, dtype, device)`` attaches a ``LinearLoRA`` to every
adaptable projection of this rank's decoder layers (q/k/v, o, gate/up, down).
``prepare(lora_requests, query_lens)`` runs before each forward: it makes sure
every adapter of the step sits in a device slot (reading it from the host LRU,
or from disk into the LRU), reusing the least recently used slot whose adapter
the step does not need, then sets the shared ``LoRABatch``. The scheduler admits
at most ``max_loras`` distinct adapters into its running batch, so a step always
finds its slots. A step without adapters leaves the mapping empty: no LoRA work.

``load_async(lora_request)`` reads an adapter from disk into the host LRU on a
thread of its own, off the step's path: the engine core holds an adapter's first
requests until it is there (``engine.lora.loading``). A step reads from disk
itself only an adapter the LRU has dropped since (``num_step_loads`` counts those).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.config import LoRAConfig
from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.layers import LinearLoRA, LoRABatch
from engine.lora_request import LoRARequest
from engine.sched.step_outputs import LoRAWorkerCounts


class LoRAManager:
    def __init__(self, model, lora_config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.arch = model.arch_config
        self.config = lora_config
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        self.layers = _attach(model, self.batch, lora_config, dtype, device)
        self.slot_ids: list[int] = [0] * lora_config.max_loras  # adapter id per slot; 0: empty
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # the host LRU
        self._host_lock = threading.Lock()  # the LRU is filled from the loading thread too
        self._loading: dict[int, Future] = {}  # adapter id -> its load in flight
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self.num_loads = self.num_slot_swaps = self.num_host_evictions = 0
        self.num_step_loads = 0  # of num_loads, those a step had to wait for (the LRU dropped the adapter)

    def counts(self) -> LoRAWorkerCounts:
        """What the engine's metrics export (``serval_lora_slot_swaps``, ``serval_lora_step_loads``)."""
        return LoRAWorkerCounts(self.num_slot_swaps, self.num_step_loads)

    def load_async(self, request: LoRARequest) -> Future:
        """Reads ``request``'s adapter into the host LRU on the loading thread; the future ends when it is
        there (or raises the loading error). Loading an adapter already there or on its way costs nothing."""
        with self._host_lock:
            if request.lora_int_id in self._host:
                done: Future = Future()
                done.set_result(None)
                return done
            future = self._loading.get(request.lora_int_id)
            if future is None:
                future = self._loader.submit(self._load, request)
                self._loading[request.lora_int_id] = future
            return future

    def _load(self, request: LoRARequest) -> None:
        try:
            adapter = load_adapter(request.lora_path, self.arch, self.config.max_lora_rank, self.dtype)
            with self._host_lock:
                self._keep(request.lora_int_id, adapter)
        finally:
            with self._host_lock:
                self._loading.pop(request.lora_int_id, None)

    def prepare(self, lora_requests: list[LoRARequest | None], query_lens: list[int]) -> None:
        """Sets the step's mapping: request i's ``query_lens[i]`` tokens (flattened in order) use its adapter."""
        wanted = {r.lora_int_id: r for r in lora_requests if r is not None}
        if not wanted:
            self.batch.groups = []
            return
        if len(wanted) > len(self.slot_ids):
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras ({len(self.slot_ids)}).")
        slot_of = {lora_id: self._slot_for(request, wanted) for lora_id, request in wanted.items()}
        ranges: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for request, num_tokens in zip(lora_requests, query_lens):
            if request is not None:
                ranges.setdefault(slot_of[request.lora_int_id], []).append((start, start + num_tokens))
            start += num_tokens
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot, spans in ranges.items():
            if spans == [(0, start)]:  # one adapter for the whole step: no gather, no scatter
                groups.append((slot, None))
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device)
                groups.append((slot, rows))
        self.batch.groups = groups

    def _slot_for(self, request: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return self._slot_of[lora_id]
        adapter = self._host_adapter(request)
        if 0 in self.slot_ids:
            slot = self.slot_ids.index(0)
        else:  # the least recently used slot whose adapter this step does not run
            victim = next(old for old in self._slot_of if old not in wanted)
            slot = self._slot_of.pop(victim)
            self.num_slot_swaps += 1
        for layer, lora_layer in self.layers:
            lora_layer.set_slot(slot, adapter, layer)
        self.slot_ids[slot] = lora_id
        self._slot_of[lora_id] = slot
        return slot

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host LRU, waiting for its load in flight, or read from disk here."""
        with self._host_lock:
            in_flight = self._loading.get(request.lora_int_id)
        if in_flight is not None:
            in_flight.result()
        with self._host_lock:
            adapter = self._host.get(request.lora_int_id)
            if adapter is not None:
                self._host.move_to_end(request.lora_int_id)
                return adapter
        adapter = load_adapter(request.lora_path, self.arch, self.config.max_lora_rank, self.dtype)
        self.num_step_loads += 1
        with self._host_lock:
            self._keep(request.lora_int_id, adapter)
        return adapter

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Puts an adapter read from disk in the host LRU, dropping the least recently used past its size."""
        self.num_loads += 1
        self._host[lora_id] = adapter
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)
            self.num_host_evictions += 1

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


def _attach(model, batch: LoRABatch, config: LoRAConfig, dtype, device) -> list[tuple[int, LinearLoRA]]:
    """A ``LinearLoRA`` on each adaptable projection of this stage's layers, as (decoder layer, it)."""
    attached = []
    decoder = model.model
    for offset, layer in enumerate(decoder.local_layers):
        index = decoder.start_layer + offset
        attn, mlp = layer.self_attn, layer.mlp
        qkv, rank = attn.qkv_proj, attn.qkv_proj.tp_rank
        q, kv = qkv.num_heads * qkv.head_dim, qkv.num_kv_heads * qkv.head_dim
        kv_source = rank // qkv.kv_replicas * kv  # KV heads replicated past num_kv_heads ranks
        inter = mlp.gate_up_proj.out_features // 2
        for linear, slices in (
            (qkv, {"q_proj": (0, q, rank * q), "k_proj": (q, kv, kv_source), "v_proj": (q + kv, kv, kv_source)}),
            (attn.o_proj, {"o_proj": (0, attn.o_proj.out_features, 0)}),
            (mlp.gate_up_proj, {"gate_proj": (0, inter, rank * inter), "up_proj": (inter, inter, rank * inter)}),
            (mlp.down_proj, {"down_proj": (0, mlp.down_proj.out_features, 0)}),
        ):
            row_parallel = linear is attn.o_proj or linear is mlp.down_proj
            in_shard = (rank * linear.in_features, linear.in_features) if row_parallel and linear.tp_size > 1 else None
            lora = LinearLoRA(
                batch, slices, linear.in_features, linear.out_features, config.max_loras, config.max_lora_rank,
                dtype, device, in_shard,
            )  # fmt: skip
            linear.lora = lora
            attached.append((index, lora))
    return attached

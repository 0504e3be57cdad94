"""The scheduler and what it schedules: requests, the paged KV block pool, prefix caching.

Pure Python by design (no torch, no ray): it can be driven and tested without
a model, and it runs wherever the engine core (``engine.core``) lives.

- ``scheduler``: ``Scheduler``, continuous batching (token budget, chunked prefill, preemption); ``SchedulerStats``.
- ``step_plan``: ``StepPlan``, one ``schedule()`` call's decisions and the ``SchedulerOutput`` read from them.
- ``step_outputs``: the plain data crossing to workers and back (``SchedulerOutput``, ``ModelRunnerOutput``,
  ``EngineCoreOutput``).
- ``request``: ``Request``, ``RequestStatus``, the ``Grammar`` protocol, ``check_prompt_fits``.
- ``request_queue``: the waiting queue under FCFS or priority; ``request_hold``: ``RequestHold``.
- ``stop_conditions``: token-level stop checks.
- ``kv_cache_manager``: ``KVCacheManager``, requests to blocks per KV cache group (allocation, prefix hits, freeing).
- ``kv_cache_groups``: ``KVCacheGroup``, the layers grouped by attention window (sliding windows' blocks dropped).
- ``block_pool``: ``BlockPool``, ``KVCacheBlock``, the free queue and the prefix cache.
- ``block_hash``: chained block hashes (the cache salt and LoRA adapter in the first block).
- ``kv_events``: ``KVEventSink`` / ``KVEventFeed``, the prefix cache's events for the KV-aware router.
- ``kv_transfer``: ``KVConnectorScheduler``, disaggregated prefill's scheduler side.
- ``spec_decode``: ``SpecDecodeScheduling``, drafts scheduled as next tokens; ``spec_decode_stats``: its counters.
"""

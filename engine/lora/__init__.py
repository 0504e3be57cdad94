"""Multi-LoRA: PEFT adapters over one base model, batched per token.

- ``adapter``: ``load_adapter``, one PEFT directory read and checked against the base model.
- ``layers``: ``LinearLoRA`` (per-projection adapter slots, shrink then expand per adapter group), ``LoRABatch``.
- ``triton_ops``: the same products as Triton kernels on CUDA (vLLM's punica shape).
- ``manager``: ``LoRAManager``, the worker's device slots, host LRU and each step's token-to-slot mapping.
- ``loading``: ``LoRALoading``, the engine core holding an adapter's first requests until every worker has it;
  ``check_lora_supported``, what LoRA can run with (checked at start-up).

``LoRARequest`` (which adapter a request runs with) is ``engine.lora_request``: a record every layer reads.
"""

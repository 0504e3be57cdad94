"""Workers: one per device. A worker owns a model runner, which owns the model and its KV cache.

- ``worker``: ``Worker``, device, process group, KV sizing, ``execute_model``; what executors drive.
- ``model_runner``: ``ModelRunner``, the only code that builds tensors: a step's stages, forward, sampling.
- ``input_batch``: ``InputBatch``, the persistent per-request state and block table, moved by the deltas.
- ``step_inputs``: ``StepInputs`` / ``build_step_inputs``, one step's flattened batch.
- ``request_state``: ``CachedRequestState`` and ``BlockTable``.
- ``sampling_inputs``: what the logits stages read from the request states.
- ``spec_decode_runner``: ``SpecDecodeRunner``, the proposer after sampling; ``draft_verifier``:
  ``DraftVerifier``, draft tokens through the rejection sampler.
- ``decode_step``: ``DecodeStep``, the one other way a runner may run decode steps: ``native_decode``'s
  ``NativeDecodeStep`` (CPU, the stack in one native call) or ``cuda_graphs``' ``DecodeGraphRunner`` (CUDA,
  captured once per batch size and replayed).
- ``profiling``: ``profile_forward``, the largest step, run once before the KV cache exists (on GPU).
"""

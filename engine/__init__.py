"""Serval's inference engine.

``from engine import LLM, SamplingParams`` is the offline API. Heavy modules
(torch, transformers) load on first use, so ``engine.sched`` stays importable
without them.

The root's modules, the entry points and the types their callers import:

- ``llm``: ``LLM``, the offline API (vLLM's shape).
- ``async_llm``: ``AsyncLLM``, the asyncio front end for serving (an ``EngineClient``).
- ``output_handler``: ``OutputHandler``, ``AsyncLLM``'s ``LLMEngine`` front end on the serving event loop
  (vLLM's ``output_handler``), fed the core client's steps by its ``StepBuffer``.
- ``llm_engine``: ``LLMEngine``, the synchronous front end: processor, core client, output processor.
- ``inputs``: ``PromptType`` and ``RequestOptions``, what a caller hands the engine with each request.
- ``engine_client``: ``EngineClient``, what a server may call on an engine; ``EngineDeadError``,
  ``EngineOverloadedError``.
- ``config``: the frozen, validated configs, one per concern, bundled in ``EngineConfig``.
- ``engine_args``: ``EngineArgs``, the flat vLLM-style keyword arguments, turned into an ``EngineConfig``.
- ``sampling_params``: ``SamplingParams``, ``StructuredOutputsParams``, ``RequestOutputKind``, ``RequestKind``.
- ``pooling_params``: ``PoolingParams``, how an embedding request's vector is finished.
- ``request_output``: ``RequestOutput``, ``CompletionOutput``, ``Logprob``, ``EmbeddingRequestOutput``: what
  users get back.
- ``lora_request``: ``LoRARequest``, which adapter a request runs with (a record every layer reads).

The layers, top first (``tests/test_import_graph.py`` keeps every import pointing down or sideways): the
front doors (``llm``, ``async_llm``, ``entrypoints``); the front end (``llm_engine``, ``output_handler``,
``frontend``, ``engine_args``, ``engine_client``); the core and its executor; a rank's worker (``worker``,
``spec_decode``, ``kv_transfer``); the model's parts (``model``, ``lora``, ``sample``, ``structured_output``,
``attention``); the kernels and ``distributed``; the scheduler's records (``sched``, ``metrics``); the
records every layer shares (``config``, ``sampling_params``, ``pooling_params``, ``request_output``, ``inputs``,
``lora_request``).

Packages: ``frontend`` (text around the core), ``core`` (the engine core and its clients), ``sched`` (the
scheduler, pure Python), ``executor``, ``worker``, ``model``, ``attention``, ``kernels``, ``sample``,
``spec_decode``, ``structured_output``, ``lora``, ``kv_transfer``, ``distributed``, ``metrics``,
``entrypoints`` (the OpenAI API).
"""

from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLM",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineArgs",
    "SamplingParams",
    "PoolingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("AsyncLLM", "EngineDeadError", "EngineOverloadedError"):
        import engine.async_llm

        return getattr(engine.async_llm, name)
    if name == "EngineArgs":
        from engine.engine_args import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        import engine.request_output

        return getattr(engine.request_output, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

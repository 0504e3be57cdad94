"""Serval's inference engine.

``from engine import LLM, SamplingParams`` is the offline API. Heavy modules
(torch, transformers) load on first use, so ``engine.sched`` stays importable
without them.

The root's modules, the entry points and the types their callers import:

- ``llm``: ``LLM``, the offline API (vLLM's shape).
- ``async_llm``: ``AsyncLLM``, the asyncio front end for serving (an ``EngineClient``).
- ``processor_thread``: ``ProcessorThread``, the thread behind ``AsyncLLM`` that alone runs its
  ``LLMEngine`` front end, fed by its ``Inbox`` (commands from the event loop, the core client's steps).
- ``llm_engine``: ``LLMEngine``, the synchronous front end: processor, core client, output processor.
- ``inputs``: ``PromptType`` and ``RequestOptions``, what a caller hands the engine with each request.
- ``engine_client``: ``EngineClient``, what a server may call on an engine; ``EngineDeadError``,
  ``EngineOverloadedError``.
- ``config``: the frozen, validated configs, one per concern, bundled in ``EngineConfig``.
- ``engine_args``: ``EngineArgs``, the flat vLLM-style keyword arguments, turned into an ``EngineConfig``.
- ``sampling_params``: ``SamplingParams``, ``StructuredOutputsParams``, ``RequestOutputKind``.
- ``request_output``: ``RequestOutput``, ``CompletionOutput``, ``Logprob``: what users get back.

Packages: ``frontend`` (text around the core), ``core`` (the engine core and its clients), ``sched`` (the
scheduler, pure Python), ``executor``, ``worker``, ``model``, ``attention``, ``kernels``, ``sample``,
``spec_decode``, ``structured_output``, ``lora``, ``kv_transfer``, ``distributed``, ``metrics``,
``entrypoints`` (the OpenAI API).
"""

from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLM",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineArgs",
    "SamplingParams",
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

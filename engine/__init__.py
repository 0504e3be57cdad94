"""Serval's inference engine.

``from engine import LLM, SamplingParams`` is the offline API. Heavy modules
(torch, transformers) load on first use, so ``engine.sched`` stays importable
without them.
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

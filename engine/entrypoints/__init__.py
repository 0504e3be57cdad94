"""Serving front doors around :class:`engine.async_llm.AsyncLLM`.

``engine.entrypoints.openai`` is the OpenAI-compatible HTTP layer. Nothing
here imports Ray: the Ray Serve deployments (``deployments/``) reuse these
objects and handler functions across their replicas.
"""

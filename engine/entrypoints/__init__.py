"""Serving front doors around an :class:`engine.engine_client.EngineClient` (``AsyncLLM`` and others).

``engine.entrypoints.openai`` is the OpenAI-compatible HTTP layer. Nothing
here imports Ray: the Ray Serve deployments (``deployments/``) reuse these
objects and handler functions across their replicas.
"""

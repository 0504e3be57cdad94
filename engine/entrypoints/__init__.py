"""Serving front doors around an :class:`engine.engine_client.EngineClient` (``AsyncLLM`` and others).

- ``openai``: the OpenAI-compatible HTTP layer (the package's own docstring lists its modules).

Nothing here imports Ray: the Ray Serve deployments (``deployments/``) reuse these
objects and handler functions across their replicas.
"""

"""The OpenAI-compatible API (vLLM's shapes), engine side.

* ``protocol``: the pydantic request / response models.
* ``errors``: ``ErrorResponse`` (OpenAI's error body plus an HTTP status) and
  the exception -> status mapping.
* ``serving``: ``OpenAIServing``, the per-model object whose endpoint methods
  are async generators of picklable items (it runs in an LLM-server replica,
  or in-process).
* ``api_server``: the FastAPI route handlers, ``ModelRouter`` /
  ``LocalModelRouter`` and ``build_app``.
"""

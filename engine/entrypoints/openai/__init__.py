"""The OpenAI-compatible API (vLLM's shapes), engine side.

* ``protocol`` / ``responses``: the pydantic request and response models.
* ``errors``: ``ErrorResponse`` (OpenAI's error body plus an HTTP status) and
  the exception -> status mapping.
* ``serving``: ``OpenAIServing``, the per-model object whose endpoint methods
  return async iterators of picklable items (it runs in an LLM-server replica,
  or in-process); it composes ``serving_completion``, ``serving_chat`` and
  ``serving_tokenize``, which do the work over an ``EngineClient``
  (``engine.engine_client``, the only engine interface this package uses);
  ``streaming`` merges engine streams and frames server-sent events,
  ``logprobs`` formats logprobs.
* ``api_server``: the FastAPI route handlers, ``ModelRouter`` /
  ``LocalModelRouter`` and ``build_app``.
"""

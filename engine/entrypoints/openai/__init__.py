"""The OpenAI-compatible API (vLLM's shapes), engine side.

* ``protocol`` / ``responses``: the pydantic request and response models.
* ``errors``: ``ErrorResponse`` (OpenAI's error body plus an HTTP status) and
  the exception -> status mapping.
* ``endpoints``: ``Endpoint``, the Enum a router names a call by;
  ``call_options``: ``CallOptions``, how one call is served (a precomputed
  prompt, a stream to continue, tracking, the LoRA adapter).
* ``serving``: ``OpenAIServing``, the per-model object whose ``call(endpoint,
  request, options)`` returns an async iterator of picklable, typed items
  (``StreamItem``: a response model, an ``ErrorResponse`` or an ``SSEChunk``;
  it runs in an LLM-server replica, or in-process); it composes
  ``serving_completion``, ``serving_chat`` and ``serving_tokenize``, which do
  the work over an ``EngineClient`` (``engine.engine_client``, the only engine
  interface this package uses); ``chat_template`` renders a conversation;
  ``streaming`` merges engine streams and frames server-sent events
  (``SSEChunk``), ``logprobs`` formats logprobs; ``continuation`` continues a
  stream on another server.
* ``api_server``: the FastAPI route handlers, ``ModelRouter`` /
  ``LocalModelRouter`` and ``build_app``.
"""

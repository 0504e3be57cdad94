"""The OpenAI-compatible API (vLLM's shapes), and Anthropic's Messages API, engine side, over an ``EngineClient``
only.

- ``protocol_base``: ``OpenAIBaseModel``, the base of every request model (unknown fields ignored, logged).
- ``protocol``: the pydantic request models, with vLLM's extra sampling fields.
- ``responses``: the response models (``/v1/completions``, ``/v1/chat/completions``, tool calls, usage).
- ``chat_messages``: ``ChatMessage``, the turns a chat request carries and how each reaches the template.
- ``chat_template``: ``render_chat``, a conversation through the tokenizer's chat template.
- ``structured``: ``StructuredOutputFields``, ``response_format`` / ``structured_outputs`` / ``guided_*`` as one
  constraint.
- ``tool_calls``: ``ToolList`` / ``ToolFields``, the request's tools checked, and the constraint a choice imposes.
- ``tool_parsers``: incremental named / required / Hermes tool-call parsers; ``json_scan``: their JSON scans.
- ``choice_parser``: ``ChoiceParser``, one choice's text split into reasoning (``engine.reasoning``), content
  and tool calls.
- ``errors``: ``ErrorResponse`` (OpenAI's error body plus an HTTP status), ``ApiStyle`` (OpenAI's or Anthropic's
  error body and stream end) and the exception -> status mapping.
- ``endpoints``: ``Endpoint``, the Enum a router names a call by (Ray Serve LLM's ``CallMethod``).
- ``call_options``: ``CallOptions``, how one call is served (a precomputed prompt, a stream to continue,
  tracking, the LoRA adapter).
- ``serving``: ``OpenAIServing``, one model's ``call(endpoint, request, options)``, an async iterator of
  picklable typed items (``StreamItem``: a response model, an ``ErrorResponse`` or an ``SSEChunk``).
- ``serving_base``: ``ServingBase``, what the servings share; ``PrecomputedPrompt``.
- ``serving_completion``, ``serving_chat``, ``serving_tokenize``: ``/v1/completions``, ``/v1/chat/completions``,
  ``/tokenize`` and ``/detokenize``.
- ``messages_protocol``, ``messages_responses``, ``serving_messages``: Anthropic's ``/v1/messages``, its request
  mapped onto a chat completion, its answer and events in Anthropic's shapes.
- The Responses API: ``responses_request`` (``ResponsesRequest``, and the chat request it is served as),
  ``response_items`` (input and output items), ``response_object`` (``ResponsesResponse``), ``serving_responses``
  (``ResponsesServing``), ``responses_output`` (output items and stream events), ``response_store``
  (``ResponseStore``, ``InMemoryResponseStore``), ``responses_routes`` (the HTTP routes, ``previous_response_id``).
- ``streaming``: merging one HTTP request's engine streams and SSE framing (``SSEChunk``, ``StreamDelta``).
- ``logprobs``: the engine's logprobs in OpenAI's two formats.
- ``continuation``: a stream continued on another server (``Continuation``, ``ResumedRequest``).
- ``lora_models``: ``LoRAModels``, one served model's adapters by name; ``lora_routes``: their HTTP routes.
- ``limits``: ``RequestLimits`` and ``LimitedRouter``, per-request limits before any model server.
- ``auth``: ``ApiKeyMiddleware``, ``Authorization: Bearer`` keys.
- ``server_options``: ``ServerOptions``, the HTTP layer's app-wide options.
- ``api_server``: the FastAPI route handlers, ``ModelRouter`` / ``LocalModelRouter`` and ``build_app``;
  ``http_responses``: an item stream as an HTTP response (``respond``), a request body parsed (``parse_body``).
"""

"""The text side of the engine's front end, around the core: prompts in, text out.

- ``processor``: ``Processor``, a prompt tokenized and validated into core ``Request``s (``n`` > 1 fans out
  here, bad words become token ids).
- ``output_processor``: ``OutputProcessor``, the core's token outputs into ``RequestOutput``s (logprobs,
  stop strings, ``n`` > 1 joins); it holds the front end's one map of requests in flight, each with the
  ``OutputStream`` its outputs go to.
- ``detokenizer``: ``IncrementalDetokenizer``, incremental, Unicode-safe detokenization and stop strings.
- ``output_collector``: ``RequestOutputCollector``, a streaming request's one-slot mailbox on the event
  loop, where the front end (``engine.output_handler``) puts its outputs for ``AsyncLLM.generate``.
"""

"""The text side of the engine's front end, around the core: prompts in, text out.

- ``processor``: ``Processor``, a prompt tokenized and validated into core ``Request``s (``n`` > 1 fans out
  here, bad words become token ids).
- ``output_processor``: ``OutputProcessor``, the core's token outputs into ``RequestOutput``s (logprobs,
  stop strings, ``n`` > 1 joins); each request's state holds its collector.
- ``detokenizer``: ``IncrementalDetokenizer``, incremental, Unicode-safe detokenization and stop strings.
- ``output_collector``: ``RequestOutputCollector``, the one-slot mailbox between the front end's thread and
  a streaming request on the event loop (``AsyncLLM``).
- ``processor_thread``: ``ProcessorThread``, that thread, which alone runs the processors while serving, fed
  by its ``Inbox`` (commands from the event loop, the core client's steps).
"""

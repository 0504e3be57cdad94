"""The text side of the engine's front end, around the core: prompts in, text out.

``processor``: tokenize and validate a prompt into core ``Request``s (``n`` > 1
fans out here, bad words become token ids). ``output_processor``: the core's
token outputs into ``RequestOutput``s (incremental ``detokenizer``, stop
strings, ``n`` > 1 joins). ``output_collector``: the one-slot mailbox between
the front end's thread and a streaming request on the event loop (``AsyncLLM``).
``processor_thread``: that thread, which alone runs the processors while serving, fed by an ``Inbox`` of
commands and core steps.
"""

"""Structured outputs (guided decoding) through xgrammar. The worker applies the bitmask in
``engine.sample.grammar_bitmask``.

- ``backend``: ``check_constraint`` (the front end, no tokenizer) and ``XgrammarBackend`` (compiles against
  the vocabulary in the core, makes matchers).
- ``manager``: ``StructuredOutputManager``, the core's side: compiles off the step's path, holds requests
  until ready, builds each step's token bitmask.
- ``request_grammar``: ``RequestGrammar``, one request's matcher.
- ``reasoning_gate``: ``ReasoningGatedGrammar``, a matcher that starts where the reasoning ends (a
  ``reasoning_parser``).
"""

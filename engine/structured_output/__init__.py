"""Structured outputs (guided decoding) through xgrammar: the backend (a constraint checked in the front end,
compiled against the vocabulary in the core), each request's matcher, and the engine core's manager
(compiles off the step's path, builds each step's token bitmask). The worker applies the bitmask in
``engine.sample.grammar_bitmask``.
"""

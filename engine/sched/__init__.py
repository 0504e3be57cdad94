"""The scheduler and what it schedules: requests, the paged KV block pool, prefix caching.

Pure Python by design (no torch, no ray): it can be driven and tested without
a model, and it runs wherever the engine core (``engine.core``) lives.
"""

"""The engine core: requests, the paged KV block pool, prefix caching and the scheduler.

Pure Python by design (no torch, no ray): it can be driven and tested without
a model, and it runs wherever the engine-core process or actor lives.
"""

"""Speculative decoding's proposers: who drafts the tokens the target verifies (``proposer`` is the protocol)."""

"""Speculative decoding's proposers: who drafts the tokens the target verifies.

- ``proposer``: the ``Proposer`` protocol (``propose(ProposerInputs)``).
- ``ngram``: ``NgramProposer``, prompt lookup over prompt + output.
- ``draft_model``: ``DraftModelProposer``, a small model with the target's vocabulary, over its own KV cache.
"""

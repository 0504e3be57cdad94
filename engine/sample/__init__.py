"""Token sampling: per-step metadata, the sampler and logprob helpers.

- ``sampler``: the ``Sampler`` in vLLM V1's order (raw logprobs, masks, penalties, greedy or a seeded draw).
- ``metadata``: ``SamplingMetadata``, the batch's sampling parameters as tensors, per-request generators.
- ``masks``: allowed ids, bad words, min_tokens, logit bias; ``penalties``: presence / frequency / repetition.
- ``filters``: temperature, min-p, top-k / top-p and the seeded draw.
- ``logprobs``: sampled and top-N logprobs; ``prompt_logprobs``: ``PromptLogprobs``, chunk by chunk.
- ``rejection_sampler``: ``RejectionSampler``, draft tokens verified losslessly.
- ``grammar_bitmask``: ``apply_grammar_bitmask``, the step's grammar bitmask on the logits.
"""

from engine.sample.logprobs import LogprobsTensors, compute_prompt_logprobs
from engine.sample.masks import tokenize_bad_words
from engine.sample.metadata import (
    RequestSamplingState,
    SamplingMetadata,
    make_generator,
    validate_token_ids,
)
from engine.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "RequestSamplingState",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "make_generator",
    "tokenize_bad_words",
    "validate_token_ids",
]

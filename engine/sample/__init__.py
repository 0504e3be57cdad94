"""Token sampling: per-step metadata, the sampler and logprob helpers."""

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

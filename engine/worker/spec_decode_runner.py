"""The output rank's speculative decoding: the step's draft verifier and the proposer after it.

Contract: ``verifier`` samples a step in which requests verify drafts (``DraftVerifier``);
``propose(req_ids, hidden_states)``, called once the step's tokens are appended, returns the next
drafts of the requests just sampled (only those that got any), each cut so that verifying it stays
within the request's max_tokens and the draft's max_model_len; None while ``disable_by_batch_size``
or more requests run. A draft model's KV cache shares the target's block ids: its per-block bytes
count in the KV budget (``kv_cache_block_bytes``) and it is allocated with the target's
(``initialize_kv_cache``).
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import ProposerInputs
from engine.worker.draft_verifier import DraftVerifier
from engine.worker.input_batch import InputBatch
from engine.worker.request_state import CachedRequestState


class SpecDecodeRunner:
    def __init__(self, config: EngineConfig, input_batch: InputBatch, vocab_size: int, eos_token_ids: list[int]):
        self.config = config.speculative_config
        self.input_batch = input_batch
        self.verifier = DraftVerifier(vocab_size, eos_token_ids, input_batch.device)
        self.draft_model = None
        if self.config.method == "draft_model":
            self.proposer = self.draft_model = DraftModelProposer(config, input_batch)
        else:
            self.proposer = NgramProposer(self.config)

    def load_model(self, dtype: torch.dtype, device: torch.device) -> None:
        if self.draft_model is not None:
            self.draft_model.load_model(dtype, device)

    def kv_cache_block_bytes(self) -> int:
        return 0 if self.draft_model is None else self.draft_model.kv_cache_block_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.draft_model is not None:
            self.draft_model.initialize_kv_cache(num_blocks)

    def propose(self, req_ids: list[str], hidden_states: torch.Tensor) -> dict[str, list[int]] | None:
        """The next drafts of ``req_ids`` (the step's sampled requests), by request id."""
        requests = self.input_batch.requests
        limit = self.config.disable_by_batch_size
        if limit is not None and len(requests) >= limit:
            return None
        states = [requests[req_id] for req_id in req_ids]
        room = [self._max_num_drafts(state) for state in states]
        drafts = self.proposer.propose(ProposerInputs(states, room, hidden_states))
        return {req_id: tokens for req_id, tokens in zip(req_ids, drafts) if tokens}

    def _max_num_drafts(self, state: CachedRequestState) -> int:
        """Drafts ``state`` may verify next: all of them and the token after must fit its limits."""
        room = min(self.config.num_speculative_tokens, self.config.max_model_len - len(state.token_ids))
        max_tokens = state.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (len(state.token_ids) - state.num_prompt_tokens) - 1)
        return max(room, 0)

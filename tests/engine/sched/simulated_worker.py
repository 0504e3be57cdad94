"""A model-free stand-in for the model runner that checks every schedule it executes.

It keeps per-request state from SchedulerOutput deltas exactly as a real
runner must, "computes" the KV of each scheduled token by writing a key of the
whole prefix ending at that token into the slot the block table names, and
then verifies that every position each request attends to holds the right
key. Wrong block tables, broken prefix-cache hits, lost deltas or tokens
computed twice all fail here. The next token is a fixed function of the
sequence, so the expected output of every request is known in advance.

With ``num_spec_tokens`` it also speculates: after sampling it proposes that
many drafts per request, each right with probability ``draft_accuracy``, and a
step verifies the scheduled drafts as a target would (the accepted ones, then
the true next token). Rejected drafts' KV stays in their slots: a later read
of such a position before it is rewritten fails the checks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.sched.step_outputs import ModelRunnerOutput, SchedulerOutput


def next_token(token_ids: list[int], vocab_size: int) -> int:
    """The simulated model: deterministic in the whole sequence."""
    return (token_ids[-1] * 7 + len(token_ids) * 13 + token_ids[0] * 3) % vocab_size


@dataclass
class _ReqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    prefix_keys: list[int] = field(default_factory=list)

    def prefix_key(self, position: int) -> int:
        while len(self.prefix_keys) <= position:
            previous = self.prefix_keys[-1] if self.prefix_keys else 17
            self.prefix_keys.append(hash((previous, self.token_ids[len(self.prefix_keys)])))
        return self.prefix_keys[position]


class SimulatedWorker:
    def __init__(
        self, num_blocks: int, block_size: int, vocab_size: int, num_spec_tokens: int = 0, draft_accuracy: float = 0.7
    ) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.draft_accuracy = draft_accuracy
        self.rng = random.Random(0)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv_slots: list[int | None] = [None] * (num_blocks * block_size)
        self.requests: dict[str, _ReqState] = {}
        self.block_writer: dict[int, str] = {}  # block id -> request id that last wrote into it
        self.hit_blocks: dict[str, list[int]] = {}  # request id -> blocks it got from the prefix cache

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids | output.preempted_req_ids:
            self.requests.pop(req_id, None)
        self._apply_deltas(output)
        scheduled = list(output.num_scheduled_tokens.items())
        drafts = output.scheduled_spec_decode_tokens
        for req_id, draft_token_ids in drafts.items():  # computed after the known tokens, like them
            self.requests[req_id].token_ids.extend(draft_token_ids)
        # Write all new KV first, then read: a forward pass does the same per layer.
        for req_id, num_tokens in scheduled:
            self._write_kv(self.requests[req_id], req_id, num_tokens)
        sampled = []
        for req_id, num_tokens in scheduled:
            state = self.requests[req_id]
            self._check_reads(state, state.num_computed_tokens + num_tokens, req_id)
            state.num_computed_tokens += num_tokens
            is_prompt_done = state.num_computed_tokens == len(state.token_ids)
            if req_id in drafts:
                sampled.append(self._verify(state, len(drafts[req_id])))
            else:
                sampled.append([next_token(state.token_ids, self.vocab_size)] if is_prompt_done else [])
        req_ids = [req_id for req_id, _ in scheduled]
        proposals = None
        if self.num_spec_tokens:
            proposals = {r: self._propose(self.requests[r], t) for r, t in zip(req_ids, sampled) if t}
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, draft_token_ids=proposals)

    def _verify(self, state: _ReqState, num_drafts: int) -> list[int]:
        """The accepted drafts and the true token after them; the rejected ones leave the sequence."""
        num_known = len(state.token_ids) - num_drafts
        tokens = []
        for position in range(num_known, len(state.token_ids) + 1):
            token = next_token(state.token_ids[:position], self.vocab_size)
            tokens.append(token)
            if position == len(state.token_ids) or state.token_ids[position] != token:
                break
        num_accepted = len(tokens) - 1
        del state.token_ids[num_known + num_accepted :]
        del state.prefix_keys[num_known + num_accepted :]
        state.num_computed_tokens = num_known + num_accepted
        return tokens

    def _propose(self, state: _ReqState, new_token_ids: list[int]) -> list[int]:
        """Drafts after this step's tokens, each right with some chance. The sequence holds every token
        the step returned but the last (accepted drafts stay in it; the last comes with the next deltas)."""
        sequence = state.token_ids + new_token_ids[-1:]
        drafts = []
        for _ in range(self.num_spec_tokens):
            token = next_token(sequence + drafts, self.vocab_size)
            if self.rng.random() >= self.draft_accuracy:
                token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            drafts.append(token)
        return drafts

    def _apply_deltas(self, output: SchedulerOutput) -> None:
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent as new twice"
            num_hit_blocks = new.num_computed_tokens // self.block_size
            assert new.num_computed_tokens % self.block_size == 0, "prefix hits are whole blocks"
            (block_ids,) = new.block_ids  # one KV cache group: full attention
            self.hit_blocks[new.req_id] = block_ids[:num_hit_blocks]
            self.requests[new.req_id] = _ReqState(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(block_ids), new.num_computed_tokens
            )
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens[i], "worker and scheduler disagree"
            start = cached.num_computed_tokens[i]
            new_token_ids = cached.new_token_ids[i]
            assert state.token_ids[start : start + len(new_token_ids)] == new_token_ids[: len(state.token_ids) - start]
            state.token_ids[start : start + len(new_token_ids)] = new_token_ids
            state.block_ids.extend(cached.new_block_ids[i][0])

    def _write_kv(self, state: _ReqState, req_id: str, num_tokens: int) -> None:
        end = state.num_computed_tokens + num_tokens
        assert num_tokens > 0 and end <= len(state.token_ids), "scheduled tokens the worker does not know"
        assert len(state.block_ids) * self.block_size >= end, "block table too short"
        for position in range(state.num_computed_tokens, end):
            block_id = state.block_ids[position // self.block_size]
            assert block_id != 0, "wrote into the null block"
            self.kv_slots[block_id * self.block_size + position % self.block_size] = state.prefix_key(position)
            self.block_writer[block_id] = req_id

    def _check_reads(self, state: _ReqState, end: int, req_id: str) -> None:
        for position in range(end):
            slot = state.block_ids[position // self.block_size] * self.block_size + position % self.block_size
            assert self.kv_slots[slot] == state.prefix_key(position), (
                f"{req_id}: stale or foreign KV at position {position}"
            )

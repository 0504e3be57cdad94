"""The model runner's ``Pooler`` on hidden states it is handed chunk by chunk (no model): whatever the chunks,
a prompt's vector is the one pooled from its whole prompt at once (LAST, MEAN, CLS); ``dimensions`` cuts it
before it is normalized; a prompt that starts again at position 0 (preempted) starts afresh."""

from __future__ import annotations

import pytest
import torch

from engine.config import PoolerConfig
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.worker.pooler import Pooler
from engine.worker.request_state import CachedRequestState
from engine.worker.step_inputs import StepInputs

HIDDEN = 8


EMBED = PoolingParams()


def state(req_id: str, num_prompt_tokens: int, params: PoolingParams | None = EMBED) -> CachedRequestState:
    prompt = list(range(num_prompt_tokens))
    sampling = SamplingParams() if params is None else None
    return CachedRequestState(req_id, prompt, sampling, list(prompt), 0, 0, pooling_params=params)


def step(chunks: list[tuple[str, int, int]]) -> StepInputs:
    """A batch of (request, start, number of tokens) chunks; only the fields the pooler reads are real."""
    offsets = [0]
    for _, _, num_tokens in chunks:
        offsets.append(offsets[-1] + num_tokens)
    return StepInputs(
        req_ids=[req_id for req_id, _, _ in chunks],
        input_ids=torch.zeros(0),
        positions=torch.zeros(0),
        attn_metadata=None,
        sampled_req_ids=[],
        sample_indices=torch.zeros(0),
        num_draft_tokens=[],
        token_offsets=offsets,
        starts=[start for _, start, _ in chunks],
        query_lens=[num_tokens for _, _, num_tokens in chunks],
    )


def pool_in_chunks(pooler: Pooler, requests: dict, hidden: dict[str, torch.Tensor], sizes: list[int]) -> dict:
    """Runs each request's prompt through steps of ``sizes`` tokens (all requests side by side in each step)."""
    pooled, position = {}, 0
    for size in sizes:
        chunks = [(r, position, min(size, len(h) - position)) for r, h in hidden.items() if position < len(h)]
        if not chunks:
            break
        # A generating request's decode row sits between them: the pooler leaves it alone.
        chunks.insert(1, ("g", 3, 1))
        rows = [hidden[r][start : start + n] if r in hidden else torch.full((1, HIDDEN), 1e6) for r, start, n in chunks]
        pooled.update(pooler.pool(requests, set(hidden), step(chunks), torch.cat(rows)))
        position += size
    return pooled


REFERENCES = {
    "LAST": lambda h: h[-1],
    "MEAN": lambda h: h.mean(dim=0),
    "CLS": lambda h: h[0],
}


@pytest.mark.parametrize("pooling_type", sorted(REFERENCES))
@pytest.mark.parametrize("sizes", [[64], [5, 5, 5, 5, 64], [1] * 20, [3, 64]])
def test_chunks_pool_to_the_whole_prompts_vector(pooling_type, sizes):
    torch.manual_seed(0)
    hidden = {"a": torch.randn(20, HIDDEN), "b": torch.randn(7, HIDDEN)}
    requests = {"a": state("a", 20), "b": state("b", 7), "g": state("g", 3, params=None)}
    pooler = Pooler(PoolerConfig(pooling_type=pooling_type))
    pooled = pool_in_chunks(pooler, requests, hidden, sizes)
    assert set(pooled) == {"a", "b"} and not pooler._partial
    for req_id, rows in hidden.items():
        expected = torch.nn.functional.normalize(REFERENCES[pooling_type](rows), dim=-1)
        torch.testing.assert_close(torch.tensor(pooled[req_id]), expected, atol=1e-6, rtol=0)


def test_dimensions_cut_before_normalizing_and_normalize_false_keeps_the_raw_vector():
    hidden = {"cut": torch.randn(4, HIDDEN), "raw": torch.randn(4, HIDDEN)}
    requests = {
        "cut": state("cut", 4, PoolingParams(dimensions=3)),
        "raw": state("raw", 4, PoolingParams(normalize=False)),
    }
    pooled = pool_in_chunks(Pooler(PoolerConfig(pooling_type="MEAN")), requests, hidden, [4])
    expected_cut = torch.nn.functional.normalize(hidden["cut"].mean(dim=0)[:3], dim=-1)
    torch.testing.assert_close(torch.tensor(pooled["cut"]), expected_cut, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(pooled["raw"]), hidden["raw"].mean(dim=0), atol=1e-6, rtol=0)
    unnormalized = Pooler(PoolerConfig(normalize=False))
    assert (
        pool_in_chunks(unnormalized, {"r": state("r", 4)}, {"r": hidden["raw"]}, [4])["r"] == hidden["raw"][-1].tolist()
    )


def test_a_prompt_started_again_at_zero_forgets_its_earlier_chunks():
    """A preempted pooling request is recomputed from position 0: its half-pooled sum must not count."""
    torch.manual_seed(1)
    rows = torch.randn(6, HIDDEN)
    requests = {"p": state("p", 6)}
    pooler = Pooler(PoolerConfig(pooling_type="MEAN"))
    assert pooler.pool(requests, {"p"}, step([("p", 0, 3)]), rows[:3] + 100.0) == {}  # then preempted
    assert pooler.pool(requests, {"p"}, step([("p", 0, 3)]), rows[:3]) == {}
    [vector] = pooler.pool(requests, {"p"}, step([("p", 3, 3)]), rows[3:]).values()
    torch.testing.assert_close(torch.tensor(vector), torch.nn.functional.normalize(rows.mean(dim=0), dim=-1))
    pooler.pool(requests, {"p"}, step([("p", 0, 3)]), rows[:3])
    pooler.forget("p")  # finished (aborted) mid-prompt
    assert not pooler._partial

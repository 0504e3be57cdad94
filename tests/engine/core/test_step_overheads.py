"""The per-step shortcuts keep what they shortcut: the sampling metadata handed out again across steps
equals a fresh build, and tokens that wait for the detokenizer give the text that step-by-step
detokenization gives (with stop strings the text is still checked every step)."""

from __future__ import annotations

import pytest
import torch

from engine.frontend.output_processor import OutputProcessor
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sched.step_outputs import EngineCoreOutput
from engine.worker.request_state import CachedRequestState
from engine.worker.sampling_inputs import SamplingMetadataCache, sampling_metadata
from tests.engine.frontend.test_detokenizer import tokenizer

VOCAB = 64


def _state(req_id: str, params: SamplingParams, num_outputs: int = 0) -> CachedRequestState:
    prompt = [3, 4, 5]
    return CachedRequestState(req_id, prompt, params, prompt + [7] * num_outputs, len(prompt) + num_outputs, 0)


def _same(a, b) -> bool:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            if not torch.equal(value, other):
                return False
        elif value != other:
            return False
    return True


def test_metadata_is_reused_only_while_the_rows_cannot_change():
    cache = SamplingMetadataCache(VOCAB, [1], torch.device("cpu"))
    greedy = [_state(f"g{i}", SamplingParams(temperature=0.0)) for i in range(3)]
    first = cache.get(greedy)
    assert cache.get(list(greedy)) is first  # the same states: handed out again
    assert cache.get(greedy[:2]) is not first  # another batch: built anew
    under_min = _state("m", SamplingParams(temperature=0.0, min_tokens=2), num_outputs=1)
    penalised = _state("p", SamplingParams(temperature=0.0, presence_penalty=0.5), num_outputs=2)
    for batch in ([*greedy, under_min], [*greedy, penalised]):
        built = cache.get(batch)
        assert cache.get(batch) is not built  # these rows change from step to step
        under_min.token_ids.append(9)
        penalised.token_ids.append(9)
        assert _same(cache.get(batch), sampling_metadata(batch, VOCAB, [1], torch.device("cpu")))
    assert cache.get([*greedy, under_min]) is cache.get([*greedy, under_min])  # past min_tokens now


def _run(params: SamplingParams, steps: list[list[int]]) -> list:
    processor = OutputProcessor(tokenizer())
    processor.add_request("r", "Hello", tokenizer().encode("Hello"), [("r", params)])
    outputs = []
    for i, token_ids in enumerate(steps):
        finish = "length" if i == len(steps) - 1 else None
        outputs += processor.process_outputs([EngineCoreOutput("r", token_ids, finish_reason=finish)])[0]
    return outputs


@pytest.mark.parametrize("stop", [[], ["fox"]])
def test_waiting_tokens_give_the_streamed_text(stop):
    ids = tokenizer().encode("The quick brown fox jumps 😀 café 日本語")
    steps = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    streamed = _run(SamplingParams(stop=stop, output_kind=RequestOutputKind.CUMULATIVE), steps)
    final = _run(SamplingParams(stop=stop, output_kind=RequestOutputKind.FINAL_ONLY), steps)
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == streamed[-1].outputs[0].text
    assert final[0].outputs[0].finish_reason == streamed[-1].outputs[0].finish_reason
    if not stop:
        assert final[0].outputs[0].text == tokenizer().decode(ids)

"""The offline ``LLM.embed`` (vLLM's) on a tiny Llama checkpoint whose ``config.json`` declares Matryoshka
dimensions, against transformers' final hidden states pooled the same way.

Every pooling type (LAST, MEAN, CLS) is checked on prompts longer than the step's token budget, so chunked
prefill pools them across steps: the vectors equal transformers' single forward (cosine > 0.9999 in
float32), and a batch equals its prompts one by one. Also: ``dimensions`` (one of the model's), embeddings
and generation in the same steps (the greedy tokens are unchanged), pooling requests never reading the
prefix cache while the blocks they computed serve a later generation, the ``runner`` refusing what it does
not serve, and the KV pool clean after every run.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import PoolingParams, SamplingParams
from engine.engine_args import EngineArgs
from engine.frontend.processor import Processor
from engine.model.architecture import Architecture
from tests.conftest import assert_pool_clean, greedy, make_llm, random_token_ids, token_prompt

CHUNK = 32  # max_num_batched_tokens: longer prompts are prefilled in several steps
MATRYOSHKA_DIMENSIONS = [16, 32, 64]
POOLED = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(dim=0), "CLS": lambda h: h[0]}


@pytest.fixture(scope="module")
def matryoshka_llama(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny Llama checkpoint, its config declaring ``matryoshka_dimensions`` (hidden_size 64)."""
    path = tmp_path_factory.mktemp("matryoshka") / "llama"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": MATRYOSHKA_DIMENSIONS}))
    return str(path)


@pytest.fixture(scope="module")
def hf_hidden(matryoshka_llama):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(matryoshka_llama, dtype=torch.float32).eval()

    def hidden(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).last_hidden_state[0]

    return hidden


@pytest.fixture(scope="module", params=sorted(POOLED))
def pooled_llm(request, matryoshka_llama):
    llm = make_llm(
        matryoshka_llama,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=64,
        pooler_config={"pooling_type": request.param},
    )
    yield request.param, llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [random_token_ids(rng, n) for n in (3, CHUNK - 1, 70, 101)]


def vectors(llm, prompts, params=None) -> list[torch.Tensor]:
    outputs = llm.embed([token_prompt(p) for p in prompts], params, use_tqdm=False)
    assert [output.prompt_token_ids for output in outputs] == prompts and all(output.finished for output in outputs)
    return [torch.tensor(output.outputs.embedding) for output in outputs]


def assert_same_vector(vector: torch.Tensor, reference: torch.Tensor) -> None:
    assert vector.shape == reference.shape
    assert torch.nn.functional.cosine_similarity(vector, reference, dim=0) > 0.9999
    torch.testing.assert_close(vector, reference, atol=1e-5, rtol=0)


def test_embed_equals_transformers_pooled_the_same_way_across_chunks(pooled_llm, prompts, hf_hidden):
    pooling_type, llm = pooled_llm
    for prompt, vector in zip(prompts, vectors(llm, prompts)):
        assert_same_vector(vector, torch.nn.functional.normalize(POOLED[pooling_type](hf_hidden(prompt)), dim=-1))
    assert_pool_clean(llm)


def test_a_batch_equals_its_prompts_one_by_one(pooled_llm, prompts):
    _, llm = pooled_llm
    batch = vectors(llm, prompts)
    for prompt, vector in zip(prompts, batch):
        [alone] = vectors(llm, [prompt])
        torch.testing.assert_close(vector, alone, atol=1e-6, rtol=0)
    assert_pool_clean(llm)


def test_dimensions_cut_the_vector_before_it_is_normalized(pooled_llm, prompts, hf_hidden):
    pooling_type, llm = pooled_llm
    [cut] = vectors(llm, prompts[2:3], PoolingParams(dimensions=16))
    [raw] = vectors(llm, prompts[2:3], PoolingParams(normalize=False))
    reference = POOLED[pooling_type](hf_hidden(prompts[2]))
    assert_same_vector(cut, torch.nn.functional.normalize(reference[:16], dim=-1))
    assert_same_vector(raw, reference)
    for bad in (20, 128):
        with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32, 64\]"):
            llm.embed(token_prompt(prompts[0]), PoolingParams(dimensions=bad), use_tqdm=False)
    assert_pool_clean(llm)


def test_embeddings_and_generation_share_the_steps_and_the_prefix_cache(pooled_llm, prompts):
    """Pooling requests run beside a generation (its greedy tokens unchanged) and never read the prefix cache;
    the blocks they computed give a later generation of the same prompt its cache hit."""
    _, llm = pooled_llm
    expected = llm.generate(token_prompt(prompts[1]), greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("gen", token_prompt(prompts[1]), greedy(20))
    for index, prompt in enumerate(prompts):
        engine.add_request(f"embed-{index}", token_prompt(prompt), PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({output.request_id: output for output in engine.step() if output.finished})
    assert finished["gen"].outputs[0].token_ids == expected
    hits = engine.get_stats().prefix_cache_hits
    vectors(llm, [prompts[3]])
    vectors(llm, [prompts[3]])  # its blocks are cached now: computed again all the same
    assert engine.get_stats().prefix_cache_hits == hits
    output = llm.generate(token_prompt(prompts[3]), greedy(2), use_tqdm=False)[0]
    assert output.num_cached_tokens == (len(prompts[3]) - 1) // 16 * 16
    assert_pool_clean(llm)


@pytest.mark.parametrize(
    "runner, params, message",
    [
        ("pooling", SamplingParams(), "serves no generation: it runs with runner='pooling'"),
        ("generate", PoolingParams(), "serves no embeddings: it runs with runner='generate'"),
    ],
)
def test_the_runner_refuses_the_kind_it_does_not_serve(matryoshka_llama, runner, params, message):
    config = EngineArgs(model=matryoshka_llama, runner=runner).create_engine_config()
    processor = Processor(config, None, 512, [1], arch=Architecture.from_model(matryoshka_llama))
    with pytest.raises(ValueError, match=message):
        processor.make_request("r", [5, 6, 7], params)


def test_dimensions_on_a_model_without_matryoshka_are_refused(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    config = EngineArgs(model=path, max_model_len=2048).create_engine_config()
    processor = Processor(config, None, 512, [1], arch=Architecture.from_model(path))
    with pytest.raises(ValueError, match="does not support Matryoshka representations"):
        processor.make_request("r", [5, 6, 7], PoolingParams(dimensions=16))
    request = processor.make_request("r", [5] * 2048, PoolingParams())  # a prompt may fill the context
    assert request.sampling_params is None and request.pooling_params == PoolingParams()
    with pytest.raises(ValueError, match="The prompt has 2049 tokens, but max_model_len is 2048"):
        processor.make_request("r", [5] * 2049, PoolingParams())

import pytest
from pydantic import ValidationError

from engine.config import CacheConfig, SchedulerConfig
from engine.sampling_params import SamplingParams


def test_configs_are_frozen_and_reject_unknown_keys():
    config = SchedulerConfig()
    with pytest.raises(ValidationError):
        config.max_num_seqs = 3
    with pytest.raises(ValidationError, match="max_num_seq"):
        SchedulerConfig(max_num_seq=3)
    with pytest.raises(ValidationError):
        CacheConfig(block_size=0)
    with pytest.raises(ValidationError):
        SchedulerConfig(policy="lifo")


def test_configs_build_from_yaml_style_dicts():
    assert CacheConfig.model_validate({"block_size": 32, "num_blocks": 100}).block_size == 32


def test_budget_must_hold_a_prompt_without_chunked_prefill():
    with pytest.raises(ValidationError, match="chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=2048)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logit_bias={1: 500.0}), "logit_bias"),
        (dict(stop=[""]), "stop"),
        (dict(allowed_token_ids=[]), "allowed"),
    ],
)
def test_bad_sampling_params_raise_clear_value_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_sampling_params_normalise_vllm_spellings():
    params = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert params.stop == ["###"] and params.top_k == 0 and params.is_greedy
    assert params.clone(seed=3).seed == 3 and params.seed is None


def test_cuda_graph_batch_sizes_are_sorted_and_positive():
    from engine.config import ModelConfig

    config = ModelConfig(model="m", cuda_graph_batch_sizes=[8, 1, 4, 4])
    assert config.cuda_graph_batch_sizes == (1, 4, 8)
    assert config.attention_backend == "auto" and not config.enforce_eager
    for bad in ([], [0, 2]):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            ModelConfig(model="m", cuda_graph_batch_sizes=bad)
    with pytest.raises(ValueError):
        ModelConfig(model="m", attention_backend="flash")

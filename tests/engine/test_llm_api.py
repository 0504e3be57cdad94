"""The offline API's contract, end to end on a tiny Qwen2 checkpoint.

Bad input raises a clear ValueError *and* leaves the engine serving the
requests already in flight (their outputs equal a clean run's); stop strings,
stop token ids, EOS, min_tokens and max_tokens end requests with vLLM's
finish and stop reasons; special tokens are skipped or kept in the text;
``chat`` renders the template; ``n`` > 1, output order, duplicate ids and
aborts behave, and every run leaves the KV pool clean.
"""

from __future__ import annotations

import functools
import random

import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from tests.conftest import assert_pool_clean, greedy, random_token_ids, token_prompt
from tests.conftest import make_llm as make_test_llm

MAX_MODEL_LEN = 128
EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = 1, 2, 3, 4
TEXT_PROMPTS = ("def main():\n", "Hello, world. The answer is", "import os\nimport sys\n")

GOOD_PARAMS = [
    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12),
    SamplingParams(temperature=0.9, seed=3, ignore_eos=True, max_tokens=12),
    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30, logprobs=2),
]


# This module's engines (float32, seed 0 from the conftest); call sites override further.
make_llm = functools.partial(make_test_llm, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return make_llm(model_path)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def run_one(llm, prompt, params):
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    assert_pool_clean(llm)
    return output


@pytest.fixture(scope="module")
def good_prompts() -> list:
    rng = random.Random(11)
    return [token_prompt(random_token_ids(rng, 40)), TEXT_PROMPTS[0], token_prompt(random_token_ids(rng, 90))]


@pytest.fixture(scope="module")
def clean_run(llm, good_prompts) -> list:
    outputs = llm.generate(good_prompts, GOOD_PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]


def drain(engine, outputs: dict) -> None:
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in outputs, "a request finished twice"
            if output.finished:
                outputs[output.request_id] = output


# ---------------------------------------------------------------- bad input

BAD_INPUTS = {
    "empty-token-ids": (lambda: (token_prompt([]), greedy(24)), "empty"),
    "empty-text": (lambda: ("", greedy(24)), "empty"),
    "prompt-of-max-model-len": (lambda: (token_prompt([7] * MAX_MODEL_LEN), greedy(24)), "max_model_len"),
    "prompt-longer-than-max-model-len": (
        lambda: (token_prompt([7] * (3 * MAX_MODEL_LEN)), greedy(24)),
        "max_model_len",
    ),
    "token-id-too-large": (lambda: (token_prompt([5, 6, 512]), greedy(24)), "vocabulary"),
    "negative-token-id": (lambda: (token_prompt([5, -1, 6]), greedy(24)), "vocabulary"),
    "float-token-id": (lambda: (token_prompt([5, 6.5]), greedy(24)), "integer token ids"),
    "token-ids-as-a-string": (lambda: ({"prompt_token_ids": "5 6 7"}, greedy(24)), "integer token ids"),
    "temperature-negative": (lambda: ("hi", SamplingParams(temperature=-0.5)), "temperature"),
    "top_p-zero": (lambda: ("hi", SamplingParams(top_p=0.0)), "top_p"),
    "top_p-above-one": (lambda: ("hi", SamplingParams(top_p=1.5)), "top_p"),
    "top_k-below-minus-one": (lambda: ("hi", SamplingParams(top_k=-2)), "top_k"),
    "min_p-above-one": (lambda: ("hi", SamplingParams(min_p=1.5)), "min_p"),
    "max_tokens-zero": (lambda: ("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    "n-zero": (lambda: ("hi", SamplingParams(n=0)), "n must"),
    "stop-token-outside-vocab": (lambda: ("hi", greedy(24, stop_token_ids=[600])), "stop_token_ids"),
    "logit-bias-outside-vocab": (lambda: ("hi", greedy(24, logit_bias={9999: 1.0})), "logit_bias"),
    "allowed-token-outside-vocab": (lambda: ("hi", greedy(24, allowed_token_ids=[5, 512])), "allowed_token_ids"),
    "stop-string-without-detokenize": (lambda: ("hi", greedy(24, stop=["x"], detokenize=False)), "detokenize"),
    "not-a-prompt": (lambda: (12345, greedy(24)), "prompt"),
    "dict-without-prompt": (lambda: ({"text": "hi"}, greedy(24)), "prompt"),
    "n>1-with-a-bad-prompt": (lambda: (token_prompt([5, 600]), greedy(24, n=3)), "vocabulary"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_and_engine_keeps_serving(llm, good_prompts, clean_run, case):
    make_bad, message = BAD_INPUTS[case]
    engine = llm.llm_engine
    ids = [f"good-{case}-{i}" for i in range(len(good_prompts))]
    for request_id, prompt, params in zip(ids, good_prompts, GOOD_PARAMS):
        engine.add_request(request_id, prompt, params)
    outputs: dict = {}
    for _ in range(3):  # the good requests are mid-flight (some decoding) when the bad one arrives
        for output in engine.step():
            assert not output.finished
    with pytest.raises(ValueError, match=message):
        engine.add_request(f"bad-{case}", *make_bad())
    # The refused id left nothing behind: it can be used for a good request right away.
    engine.add_request(f"bad-{case}", good_prompts[0], GOOD_PARAMS[0])
    drain(engine, outputs)
    assert sorted(outputs) == sorted(ids + [f"bad-{case}"])
    got = [(outputs[i].outputs[0].token_ids, outputs[i].outputs[0].text) for i in ids]
    assert got == clean_run
    assert outputs[f"bad-{case}"].outputs[0].token_ids == clean_run[0][0]
    assert_pool_clean(llm)


def test_bad_input_messages_are_clear(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"prompt has 128 tokens, but max_model_len is 128"):
        engine.add_request("long", token_prompt([7] * 128), greedy(24))
    with pytest.raises(ValueError, match=r"outside the vocabulary \(size 512\): \[512, 900\]"):
        engine.add_request("oov", token_prompt([5, 512, 900]), greedy(24))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1"):
        SamplingParams(temperature=-1)
    assert not engine.has_unfinished_requests()


def test_generate_with_one_bad_prompt_runs_nothing(llm, good_prompts, clean_run):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([good_prompts[0], token_prompt([5, 512]), good_prompts[1]], greedy(24), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([good_prompts[0], token_prompt([])], greedy(24), use_tqdm=False)
    assert_pool_clean(llm)
    outputs = llm.generate(good_prompts, GOOD_PARAMS, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs] == clean_run


def test_prompt_of_max_model_len_minus_one_gets_one_token(llm):
    output = run_one(llm, token_prompt([7] * (MAX_MODEL_LEN - 1)), greedy(10))
    assert len(output.outputs[0].token_ids) == 1 and output.outputs[0].finish_reason == "length"
    # max_tokens=None means "up to max_model_len".
    output = run_one(llm, token_prompt([7] * (MAX_MODEL_LEN - 5)), greedy(None))
    assert len(output.outputs[0].token_ids) == 5 and output.outputs[0].finish_reason == "length"


def test_logprobs_edge_counts(llm):
    """A one-token prompt has prompt_logprobs [None]; -1 asks for the whole vocabulary."""
    out = run_one(llm, token_prompt([77]), greedy(2, prompt_logprobs=3, logprobs=-1))
    assert out.prompt_logprobs == [None]
    assert [len(position) for position in out.outputs[0].logprobs] == [512, 512]
    out = run_one(llm, token_prompt([77, 78, 79]), greedy(1, prompt_logprobs=-1))
    assert out.prompt_logprobs[0] is None and [len(p) for p in out.prompt_logprobs[1:]] == [512, 512]
    assert sorted(lp.rank for lp in out.prompt_logprobs[1].values()) == list(range(1, 513))


# ------------------------------------------------------ stopping and lengths


def choose_stop_string(text: str, min_start: int = 3, length: int = 3) -> tuple[str, int]:
    """A printable substring of ``text`` whose first occurrence starts at index >= ``min_start``."""
    for start in range(min_start, len(text) - length):
        candidate = text[start : start + length]
        if candidate.isprintable() and candidate.strip() == candidate and text.find(candidate) == start:
            return candidate, start
    raise AssertionError(f"no usable stop string in {text!r}")


def tokens_until(tokenizer, token_ids: list[int], stop: str) -> list[int]:
    """The shortest prefix of ``token_ids`` whose text contains ``stop``."""
    for end in range(1, len(token_ids) + 1):
        if stop in tokenizer.decode(token_ids[:end], skip_special_tokens=True):
            return token_ids[:end]
    raise AssertionError(f"{stop!r} never appears")


@pytest.mark.parametrize("prompt", TEXT_PROMPTS)
def test_stop_strings(llm, tokenizer, prompt):
    reference = run_one(llm, prompt, greedy(24)).outputs[0]
    text, tokens = reference.text, reference.token_ids
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    stop, start = choose_stop_string(text)
    expected_tokens = tokens_until(tokenizer, tokens, stop)

    out = run_one(llm, prompt, greedy(24, stop=[stop])).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:start], "stop", stop)
    assert out.token_ids == expected_tokens

    out = run_one(llm, prompt, greedy(24, stop=[stop], include_stop_str_in_output=True)).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[: start + len(stop)], "stop", stop)
    assert out.token_ids == expected_tokens

    # Several stop strings: the earliest match in the text wins, whatever the list order.
    later, later_start = choose_stop_string(text, min_start=start + len(stop) + 1)
    out = run_one(llm, prompt, greedy(24, stop=[later, stop])).outputs[0]
    assert (out.text, out.stop_reason) == (text[:start], stop)
    out = run_one(llm, prompt, greedy(24, stop=[later])).outputs[0]
    assert (out.text, out.stop_reason) == (text[:later_start], later)

    # A stop string that no output contains changes nothing.
    out = run_one(llm, prompt, greedy(24, stop=["\x00never\x00"])).outputs[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (tokens, text, "length", None)


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm, tokenizer):
    """vLLM: a matched stop string ends the request with finish_reason "stop", even on its last token."""
    prompt = TEXT_PROMPTS[0]
    reference = run_one(llm, prompt, greedy(24)).outputs[0]
    stop, start = choose_stop_string(reference.text)
    expected_tokens = tokens_until(tokenizer, reference.token_ids, stop)
    out = run_one(llm, prompt, greedy(len(expected_tokens), stop=[stop])).outputs[0]
    assert out.token_ids == expected_tokens
    assert (out.text, out.finish_reason, out.stop_reason) == (reference.text[:start], "stop", stop)


def test_stop_token_ids(llm, tokenizer):
    prompt = TEXT_PROMPTS[0]
    tokens = run_one(llm, prompt, greedy(24)).outputs[0].token_ids
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop_id = tokens[index]
    out = run_one(llm, prompt, greedy(24, stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == tokens[: index + 1]  # the stop token is part of the output ids...
    assert out.text == tokenizer.decode(tokens[:index])  # ...but not of the text
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    out = run_one(llm, prompt, greedy(24, stop_token_ids=[stop_id], include_stop_str_in_output=True)).outputs[0]
    assert out.text == tokenizer.decode(tokens[: index + 1])
    # min_tokens holds a stop token back (it is masked until then).
    out = run_one(llm, prompt, greedy(40, stop_token_ids=[stop_id], min_tokens=index + 2)).outputs[0]
    assert stop_id not in out.token_ids[: index + 2] and len(out.token_ids) > index + 2
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (stop_id, "stop", stop_id)


def test_eos_and_min_tokens(llm):
    prompt = TEXT_PROMPTS[1]
    force_eos = {EOS_ID: 100.0}
    out = run_one(llm, prompt, SamplingParams(temperature=0.0, logit_bias=force_eos, max_tokens=10)).outputs[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([EOS_ID], "", "stop", None)
    out = run_one(
        llm, prompt, SamplingParams(temperature=0.0, logit_bias=force_eos, min_tokens=4, max_tokens=10)
    ).outputs[0]
    assert len(out.token_ids) == 5 and EOS_ID not in out.token_ids[:4] and out.token_ids[4] == EOS_ID
    assert out.finish_reason == "stop" and out.stop_reason is None
    # Sampling too: min_tokens masks EOS for random rows.
    out = run_one(
        llm, prompt, SamplingParams(temperature=1.0, seed=1, logit_bias=force_eos, min_tokens=3, max_tokens=10)
    ).outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[3] == EOS_ID
    # ignore_eos: EOS is generated but does not stop the request.
    out = run_one(
        llm, prompt, SamplingParams(temperature=0.0, logit_bias=force_eos, ignore_eos=True, max_tokens=6)
    ).outputs[0]
    assert (out.token_ids, out.finish_reason) == ([EOS_ID] * 6, "length")


def test_max_tokens_gives_length(llm, good_prompts):
    for max_tokens in (1, 7):
        out = run_one(llm, good_prompts[0], greedy(max_tokens)).outputs[0]
        assert len(out.token_ids) == max_tokens
        assert (out.finish_reason, out.stop_reason) == ("length", None)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(llm, tokenizer, skip):
    # A very hot, restricted distribution: a near-uniform mix of special (2, 3) and ordinary tokens.
    params = SamplingParams(
        temperature=50.0,
        seed=0,
        allowed_token_ids=[IM_START_ID, IM_END_ID, 37, 325],
        max_tokens=24,
        skip_special_tokens=skip,
    )
    out = run_one(llm, TEXT_PROMPTS[0], params).outputs[0]
    ids = out.token_ids
    assert set(ids) <= {IM_START_ID, IM_END_ID, 37, 325}
    assert {IM_START_ID, IM_END_ID} & set(ids) and {37, 325} & set(ids)
    assert out.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in out.text or "<|im_start|>" in out.text) == (not skip)


def test_streaming_deltas_add_up_to_the_final_text(llm, tokenizer):
    prompt = TEXT_PROMPTS[2]
    final = run_one(llm, prompt, greedy(30)).outputs[0]
    stop, start = choose_stop_string(final.text, min_start=8)
    engine = llm.llm_engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(f"stream-{kind.name}", prompt, greedy(30, stop=[stop], output_kind=kind))
        pieces, token_ids, finished = [], [], []
        while engine.has_unfinished_requests():
            for output in engine.step():
                pieces.append(output.outputs[0].text)
                token_ids.append(output.outputs[0].token_ids)
                finished.append(output.finished)
        assert finished[-1] and not any(finished[:-1])
        if kind == RequestOutputKind.DELTA:
            text, ids = "".join(pieces), [t for chunk in token_ids for t in chunk]
        else:
            assert all(a == b[: len(a)] for a, b in zip(pieces, pieces[1:]))  # the text only grows
            text, ids = pieces[-1], token_ids[-1]
        assert text == final.text[:start], kind
        assert ids == tokens_until(tokenizer, final.token_ids, stop)
        assert all(stop not in piece for piece in pieces)  # never streamed, even partly
    assert_pool_clean(llm)


# --------------------------------------------------------------- the rest


def test_text_prompt_forms(llm, tokenizer):
    text = TEXT_PROMPTS[1]
    by_text = run_one(llm, text, greedy(5))
    by_dict = run_one(llm, {"prompt": text}, greedy(5))
    ids = tokenizer(text)["input_ids"]
    by_ids = run_one(llm, token_prompt(ids), greedy(5))
    assert by_text.prompt == by_dict.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_dict.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert ids[0] != 0  # Qwen tokenizers add no BOS
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_chat_renders_the_template(arch, tiny_checkpoint):
    llm = make_llm(tiny_checkpoint(arch))
    tokenizer = llm.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    ]
    outputs = llm.chat(conversations, greedy(6), use_tqdm=False)
    assert len(outputs) == 2
    for conversation, output in zip(conversations, outputs):
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert output.prompt == rendered
        assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")
        assert output.prompt_token_ids[0] == IM_START_ID  # no BOS in front, even for llama
        assert output.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert output.prompt_token_ids.count(IM_START_ID) == len(conversation) + 1
        same = llm.generate(token_prompt(output.prompt_token_ids), greedy(6), use_tqdm=False)[0]
        assert same.outputs[0].token_ids == output.outputs[0].token_ids
    single = llm.chat(conversations[0], greedy(6), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert_pool_clean(llm)


def test_n_greater_than_one(llm, good_prompts):
    outputs = llm.generate(good_prompts[:2], greedy(8, n=3), use_tqdm=False)
    single = llm.generate(good_prompts[:2], greedy(8), use_tqdm=False)
    for output, reference in zip(outputs, single):
        assert len(output.outputs) == 3 and [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.token_ids == reference.outputs[0].token_ids for c in output.outputs)  # greedy: all equal
        assert output.finished
    sampled = llm.generate(
        good_prompts[0], SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(sampled.outputs) == 4 and len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert_pool_clean(llm)


def test_output_order_is_prompt_order(llm):
    rng = random.Random(3)
    lengths = [90, 3, 50, 12, 70, 1, 30]
    max_tokens = [25, 1, 10, 20, 2, 15, 5]  # the first prompt finishes last, the second first
    prompts = [token_prompt(random_token_ids(rng, n)) for n in lengths]
    outputs = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    assert len({o.request_id for o in outputs}) == len(prompts)
    assert_pool_clean(llm)


def test_duplicate_request_id(llm, good_prompts, clean_run):
    engine = llm.llm_engine
    engine.add_request("dup", good_prompts[0], GOOD_PARAMS[0])
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", good_prompts[1], GOOD_PARAMS[0])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", good_prompts[1], greedy(24, n=2))
    outputs: dict = {}
    drain(engine, outputs)
    assert list(outputs) == ["dup"] and outputs["dup"].outputs[0].token_ids == clean_run[0][0]
    # Once finished, the id is free again.
    engine.add_request("dup", good_prompts[0], GOOD_PARAMS[0])
    outputs = {}
    drain(engine, outputs)
    assert outputs["dup"].outputs[0].token_ids == clean_run[0][0]
    assert_pool_clean(llm)


def test_child_ids_of_n_do_not_clash_with_user_ids(llm, good_prompts, clean_run):
    """``n`` > 1 fans out into core ids "i_<id>"; neither kind of id may take over the other."""
    engine = llm.llm_engine
    engine.add_request("0_x", good_prompts[0], GOOD_PARAMS[0])
    with pytest.raises(ValueError, match="in-flight request id '0_x'"):
        engine.add_request("x", good_prompts[1], greedy(4, n=2))
    engine.add_request("y", good_prompts[1], greedy(4, n=2, output_kind=RequestOutputKind.FINAL_ONLY))
    with pytest.raises(ValueError, match="in-flight request id '1_y'"):
        engine.add_request("1_y", good_prompts[0], GOOD_PARAMS[0])
    outputs: dict = {}
    drain(engine, outputs)
    assert sorted(outputs) == ["0_x", "y"]
    assert outputs["0_x"].outputs[0].token_ids == clean_run[0][0] and len(outputs["0_x"].outputs) == 1
    assert outputs["0_x"].prompt_token_ids == good_prompts[0]["prompt_token_ids"]
    assert len(outputs["y"].outputs) == 2
    assert_pool_clean(llm)


def test_abort_frees_blocks(llm, good_prompts, clean_run):
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    free_before = kv.block_pool.num_free_blocks
    for i, (prompt, params) in enumerate(zip(good_prompts, GOOD_PARAMS)):
        engine.add_request(f"keep-{i}", prompt, params)
    engine.add_request("abort-running", good_prompts[2], greedy(50))
    engine.add_request("abort-n", good_prompts[1], greedy(50, n=3))
    engine.step()
    engine.step()
    assert "abort-running" in kv.req_to_blocks and "0_abort-n" in kv.req_to_blocks
    held = len(kv.req_to_blocks["abort-running"][0])
    free_mid = kv.block_pool.num_free_blocks
    engine.abort_request(["abort-running", "abort-n", "never-existed"])
    assert not {"abort-running", "0_abort-n", "1_abort-n", "2_abort-n"} & set(kv.req_to_blocks)
    assert not {"abort-running", "0_abort-n", "1_abort-n", "2_abort-n"} & set(scheduler.requests)
    assert kv.block_pool.num_free_blocks > free_mid and held > 0
    kv.check_integrity()
    # An aborted request can also be one that never ran.
    engine.add_request("abort-waiting", good_prompts[0], greedy(24))
    engine.abort_request(["abort-waiting"])
    outputs: dict = {}
    drain(engine, outputs)
    assert sorted(outputs) == ["keep-0", "keep-1", "keep-2"]
    assert [
        (outputs[f"keep-{i}"].outputs[0].token_ids, outputs[f"keep-{i}"].outputs[0].text) for i in range(3)
    ] == clean_run
    assert kv.block_pool.num_free_blocks == free_before
    assert_pool_clean(llm)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stream_interval_sends_the_first_token_then_every_n(model_path, kind):
    """vLLM's stream_interval: outputs after 1, 1+4, 1+8 tokens and at the end; the same text and tokens."""
    llm = make_llm(model_path, stream_interval=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=kind)
    engine = llm.llm_engine
    engine.add_request("streamed", token_prompt(random_token_ids(random.Random(3), 12)), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    if kind == RequestOutputKind.DELTA:
        counts = [len(o.outputs[0].token_ids) for o in outputs]
        token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outputs)
    else:
        counts = [len(o.outputs[0].token_ids) for o in outputs]
        token_ids, text = outputs[-1].outputs[0].token_ids, outputs[-1].outputs[0].text
    assert counts == ([1, 4, 4, 1] if kind == RequestOutputKind.DELTA else [1, 5, 9, 10])
    assert [o.finished for o in outputs] == [False, False, False, True]
    expected = (
        make_llm(model_path)
        .generate(
            token_prompt(random_token_ids(random.Random(3), 12)),
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
    )
    assert (token_ids, text) == (expected.token_ids, expected.text)
    assert_pool_clean(llm)

"""``serval bench perplexity``: a model's perplexity on a fixed public text, through the in-process engine.

The text is the English prose of Python's own interactive help (``pydoc_data.topics.topics``, shipped with
the interpreter): its topics in sorted order, joined by blank lines, so every machine scores the same
tokens and nothing downloads. It is held out in the sense that matters here: nothing in this repository
trains or tunes on it (Serval's trained models learn from stdlib *sources*, serval/tools/tokenizer_trainer.py),
and a pretrained model may well have seen Python's docs, which are public; so it is "a fixed public text",
not unseen text. It compares a model with itself (a quantized file against its float dequantization), for
which that does not matter.

The text is tokenized without special tokens and cut into windows of ``--window`` tokens starting every
``--stride`` tokens (default: the window, no overlap). Each window is one prompt of
``engine.LLM.generate`` with ``SamplingParams(prompt_logprobs=0, max_tokens=1)``; a window scores the
logprob of each of its tokens that no earlier window scored, given the tokens before it in the window;
a window's first token has no context there and is not scored (with no overlap, one token a window goes
unscored). Perplexity is ``exp`` of the mean
negative logprob over every scored token.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from serval.bench.throughput import add_engine_arguments, build_llm, engine_kwargs_from_args

SUMMARY = "perplexity of a model on a fixed public text (Python's pydoc topics) through the in-process engine"


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` of the text; scores the tokens from ``first_scored`` on."""

    begin: int
    end: int
    first_scored: int


@dataclass
class PerplexityResult:
    model: str
    window: int
    stride: int
    num_windows: int
    num_tokens_scored: int
    total_nll: float

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.num_tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_nll": self.mean_nll, "perplexity": self.perplexity}


def held_out_text() -> str:
    """The text (the module docstring): Python's pydoc topics, sorted by name, joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def windows(num_tokens: int, window: int, stride: int, max_windows: int | None = None) -> list[Window]:
    """The windows over ``num_tokens`` tokens (the module docstring), at most ``max_windows`` of them."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"--window must be at least 2 and --stride between 1 and the window, got {window}, {stride}")
    result: list[Window] = []
    scored_up_to = 1  # token 0 has no context
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + window, num_tokens)
        if end <= scored_up_to:
            continue
        result.append(Window(begin, end, max(scored_up_to, begin + 1)))
        scored_up_to = end
        if end == num_tokens or len(result) == max_windows:
            break
    return result


def window_nll(token_ids: list[int], prompt_logprobs: list, first: int) -> tuple[float, int]:
    """The negative logprob sum and count of ``token_ids[first:]`` from one prompt's ``prompt_logprobs``
    (``RequestOutput.prompt_logprobs``: position -> {token id: Logprob}, None at position 0)."""
    nll = -sum(prompt_logprobs[i][token_ids[i]].logprob for i in range(first, len(token_ids)))
    return nll, len(token_ids) - first


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--window", type=int, default=512, help="tokens per window (one prompt)")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: --window)")
    parser.add_argument("--max-windows", type=int, default=32, help="score at most this many windows (0: all)")
    parser.add_argument("--batch-windows", type=int, default=8, help="windows per generate call (progress step)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed (the windows are deterministic)")
    parser.add_argument("--output-json", metavar="PATH", help="write the result (and engine arguments) to this file")


def run(args: argparse.Namespace) -> int:
    if args.max_windows < 0 or args.batch_windows < 1:
        print("serval bench perplexity: --max-windows must be at least 0, --batch-windows at least 1", file=sys.stderr)
        return 1
    try:
        result = _benchmark(args)
    except ValueError as error:
        print(f"serval bench perplexity: {error}", file=sys.stderr)
        return 1
    print(f"Windows: {result.num_windows} of {result.window} tokens (stride {result.stride})")
    print(f"Tokens scored: {result.num_tokens_scored}")
    print(f"Mean NLL: {result.mean_nll:.6f}")
    print(f"Perplexity: {result.perplexity:.4f}")
    if args.output_json:
        record = {**result.to_dict(), "engine_kwargs": engine_kwargs_from_args(args, args.seed)}
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=4)
    return 0


def _benchmark(args: argparse.Namespace) -> PerplexityResult:
    stride = args.stride or args.window
    llm = build_llm(args, seed=args.seed)
    try:
        token_ids = llm.get_tokenizer().encode(held_out_text(), add_special_tokens=False)
        spans = windows(len(token_ids), args.window, stride, args.max_windows or None)
        total_nll, scored = measure_nll(llm, token_ids, spans, args.batch_windows)
    finally:
        llm.shutdown()
    return PerplexityResult(args.model, args.window, stride, len(spans), scored, total_nll)


def measure_nll(llm, token_ids: list[int], spans: list[Window], batch: int, log=print) -> tuple[float, int]:
    """The summed negative logprob and count of the tokens ``spans`` score, ``batch`` windows a
    ``llm.generate`` call; logs the running perplexity after each call."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    total_nll, scored = 0.0, 0
    for start in range(0, len(spans), batch):
        chunk = spans[start : start + batch]
        prompts = [{"prompt_token_ids": token_ids[w.begin : w.end]} for w in chunk]
        for w, output in zip(chunk, llm.generate(prompts, params, use_tqdm=False)):
            nll, count = window_nll(output.prompt_token_ids, output.prompt_logprobs, w.first_scored - w.begin)
            total_nll, scored = total_nll + nll, scored + count
        log(
            f"windows {start + len(chunk)}/{len(spans)}: {scored} tokens, perplexity {math.exp(total_nll / scored):.4f}"
        )
    return total_nll, scored

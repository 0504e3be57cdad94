"""``serval bench perplexity`` (serval/bench/perplexity.py) on the real SmolLM2-135M-Instruct directory (float32).

* The command's perplexity over two windows equals transformers' own on the same tokens (the same windows,
  the same scored positions) within 1e-3 relative, and it prints and writes (``--output-json``) its result.
* The windows score every token of the text after the first exactly once, whatever the stride.
"""

from __future__ import annotations

import json
import math

import pytest

from serval.bench.perplexity import held_out_text, windows
from serval.cli import main as cli_main

WINDOW = 96
STRIDE = 64
NUM_WINDOWS = 2


def transformers_nll(path: str, token_ids: list[int], spans) -> tuple[float, int]:
    """transformers' summed negative logprob and count of the tokens ``spans`` score (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for span in spans:
            ids = torch.tensor([token_ids[span.begin : span.end]])
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            positions = torch.arange(span.first_scored - span.begin, span.end - span.begin)
            total -= logprobs[positions - 1, ids[0, positions]].sum().item()
            count += len(positions)
    return total, count


def test_the_perplexity_is_transformers_and_is_printed_and_written(smollm2_path, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "ppl.json"
    argv = ["bench", "perplexity", "--model", smollm2_path, "--dtype", "float32", "--window", str(WINDOW)]
    argv += ["--stride", str(STRIDE), "--max-windows", str(NUM_WINDOWS), "--max-model-len", "256"]
    argv += ["--kv-cache-memory-bytes", str(32 << 20), "--output-json", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())

    token_ids = AutoTokenizer.from_pretrained(smollm2_path).encode(held_out_text(), add_special_tokens=False)
    spans = windows(len(token_ids), WINDOW, STRIDE, NUM_WINDOWS)
    nll, count = transformers_nll(smollm2_path, token_ids, spans)
    assert record["num_windows"] == NUM_WINDOWS and record["num_tokens_scored"] == count == WINDOW - 1 + STRIDE
    assert record["mean_nll"] == pytest.approx(nll / count, rel=1e-3)
    assert record["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-3)
    assert record["perplexity"] == pytest.approx(math.exp(record["total_nll"] / count), rel=1e-12)
    assert record["engine_kwargs"]["dtype"] == "float32" and record["window"] == WINDOW
    assert f"Windows: {NUM_WINDOWS} of {WINDOW} tokens (stride {STRIDE})" in printed
    assert f"Tokens scored: {count}\n" in printed
    assert f"Mean NLL: {record['mean_nll']:.6f}\n" in printed and f"Perplexity: {record['perplexity']:.4f}\n" in printed
    assert f"windows {NUM_WINDOWS}/{NUM_WINDOWS}: {count} tokens" in printed


@pytest.mark.parametrize("window,stride", [(8, 8), (8, 3), (5, 1), (100, 100)])
def test_the_windows_score_every_token_after_the_first_once(window, stride):
    spans = windows(41, window, stride)
    scored = [i for span in spans for i in range(span.first_scored, span.end)]
    # With no overlap each window's first token has no context in it and goes unscored.
    assert scored == [i for i in range(1, 41) if stride < window or i % window]
    assert all(span.end - span.begin <= window and span.first_scored > span.begin for span in spans)
    assert len(scored) == len(set(scored))


def test_the_text_is_fixed_and_bad_windows_are_refused():
    assert held_out_text() == held_out_text() and len(held_out_text()) > 100_000
    with pytest.raises(ValueError, match="--window must be at least 2"):
        windows(100, 8, 9)
    assert len(windows(10_000, 8, 8, max_windows=3)) == 3

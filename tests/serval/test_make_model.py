"""Tests for ``serval make-model`` (serval/tools/make_model.py)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors import safe_open

from serval.cli import main as cli_main
from serval.tools.checkpoint import ARCHS, SPEC_FILE, build_config
from serval.tools.make_model import make_model
from serval.tools.tokenizer_trainer import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID
from serval.tools.weights import parameter_shapes

ARCH_NAMES = sorted(ARCHS)
# Measured median top1-top2 gap on random prompts is ~0.7-1.0 for every
# arch/size/tying (logit std ~4); 0.1 leaves a wide margin yet is 10x the
# 1e-2 needed for exact greedy comparisons in float32.
MIN_MEDIAN_GAP = 0.1


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def _random_prompts(vocab_size: int, batch: int = 8, length: int = 24) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(PAD_ID + 1, vocab_size, (batch, length), generator=gen)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Build each arch's tiny checkpoint once per module: {arch: path}."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, arch=arch, size="tiny", quiet=True) for arch in ARCH_NAMES}


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tiny_loads_in_transformers(tiny, arch):
    from transformers import AutoTokenizer

    model, info = _load(tiny[arch])
    assert type(model).__name__ == ARCHS[arch][1]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = model.config
    assert config.architectures == [ARCHS[arch][1]]
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert config.max_position_embeddings == 4096
    assert config.tie_word_embeddings == ARCHS[arch][2]
    names = dict(model.named_parameters())
    assert any(n.endswith("q_proj.bias") for n in names) == (arch == "qwen2")
    assert any(n.endswith("q_norm.weight") for n in names) == (arch in ("qwen3", "gemma3"))
    tokenizer = AutoTokenizer.from_pretrained(tiny[arch])
    assert len(tokenizer) == config.vocab_size == 512
    assert tokenizer.eos_token_id == EOS_ID and tokenizer.pad_token_id == PAD_ID
    spec = json.loads((tiny[arch] / SPEC_FILE).read_text())
    assert spec["num_parameters"] == model.num_parameters()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_logits_are_decisive(tmp_path, arch, tie):
    model, _ = _load(make_model(tmp_path, arch=arch, tie_word_embeddings=tie, quiet=True))
    with torch.no_grad():
        out = model(_random_prompts(model.config.vocab_size), output_hidden_states=True)
    top2 = out.logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median().item() > MIN_MEDIAN_GAP
    assert (gaps < 1e-3).float().mean().item() < 0.05
    for hidden in out.hidden_states:  # neither exploding nor vanishing
        assert 0.1 < hidden.pow(2).mean().sqrt().item() < 10


def test_same_seed_is_byte_identical_other_seed_differs(tmp_path):
    first = make_model(tmp_path / "a", arch="qwen2", seed=7, quiet=True)
    again = make_model(tmp_path / "b", arch="qwen2", seed=7, quiet=True)
    other = make_model(tmp_path / "c", arch="qwen2", seed=8, quiet=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(first / name) == _sha256(again / name)
    assert _sha256(first / "model.safetensors") != _sha256(other / "model.safetensors")


def test_sharded_checkpoint_has_valid_index_and_same_weights(tmp_path, tiny):
    sharded = make_model(tmp_path, arch="llama", max_shard_size=100_000, quiet=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    stored = {}
    for name in files:
        with safe_open(str(sharded / name), framework="pt") as handle:
            stored.update({key: handle.get_tensor(key) for key in handle.keys()})
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in stored.values())
    with safe_open(str(tiny["llama"] / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():
            assert torch.equal(handle.get_tensor(key), stored[key])
    model, info = _load(sharded)
    assert not info["missing_keys"]


def test_bfloat16_checkpoint(tmp_path):
    path = make_model(tmp_path, arch="qwen3", dtype="bfloat16", quiet=True)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        assert all(handle.get_tensor(k).dtype == torch.bfloat16 for k in handle.keys())


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tokenizer_round_trip_and_chat_template(tiny, arch):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny[arch])
    raw = Tokenizer.from_file(str(tiny[arch] / "tokenizer.json"))
    text = "héllo wörld — 你好 🙂\n\tdef f(x): return x  # ok<|im_end|>I'm 42"
    ids = tokenizer(text)["input_ids"]
    assert ids == raw.encode(text).ids  # engines loading tokenizer.json agree with HF
    assert (ids[0] == BOS_ID) == ARCHS[arch][3]
    assert IM_END_ID in ids and max(ids) < 512
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")
    assert raw.decode(ids, skip_special_tokens=False).endswith(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "chat_template" in json.loads((tiny[arch] / "tokenizer_config.json").read_text())
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert chat_ids.count(IM_START_ID) == 3 and chat_ids.count(IM_END_ID) == 2


def test_idempotent_and_force(tmp_path, capsys):
    path = make_model(tmp_path / "m", arch="mistral", quiet=True)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    make_model(path, arch="mistral")
    assert "already up to date" in capsys.readouterr().out
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    make_model(path, arch="mistral", seed=1, quiet=True)  # new spec: rebuilt
    assert json.loads((path / SPEC_FILE).read_text())["seed"] == 1


def test_refuses_to_clear_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_model(tmp_path, quiet=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_cli_help_and_make_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0 and "make-model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["make-model", "--help"])
    assert exit_info.value.code == 0 and "--max-shard-size" in capsys.readouterr().out
    out_dir = tmp_path / "cli"
    assert (
        cli_main(
            [
                "make-model",
                str(out_dir),
                "--arch",
                "qwen3",
                "--no-tie-word-embeddings",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert "qwen3/tiny" in capsys.readouterr().out
    spec = json.loads((out_dir / SPEC_FILE).read_text())
    assert spec["seed"] == 3 and spec["tie_word_embeddings"] is False


def test_w2_preset_is_about_5m_parameters():
    count = sum(math.prod(s) for s in parameter_shapes(build_config("llama", "w2", tie_word_embeddings=True)).values())
    assert 4.5e6 < count < 5.5e6

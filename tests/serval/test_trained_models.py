"""The committed trained pair (assets/trained: ``serval make-model assets/trained --train``) and its training code.

The pair: both load in transformers and in Serval, share one tokenizer, the draft is distilled from the
committed target's very weights, and Serval's greedy continuation of a stdlib-like prompt equals
transformers' token for token. The training code: training and distillation deterministic to the bit
on a tiny config, the distillation loss, the schedule, data order and held-out split.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from serval.tools import distill, train_model
from serval.tools.checkpoint import SPEC_FILE, build_config
from serval.tools.tokenizer_trainer import BOS_ID
from tests.conftest import REPO_ROOT, HFReference, make_llm

TRAINED = REPO_ROOT / "assets" / "trained"
TARGET, DRAFT = TRAINED / train_model.TARGET_NAME, TRAINED / train_model.DRAFT_NAME
PAIR_PATHS = (TARGET, DRAFT)
PROMPT = "def __init__(self"
MAX_TOKENS = 24
BUDGET_BYTES = 25 * 1024 * 1024


def _spec(path: Path) -> dict:
    return json.loads((path / SPEC_FILE).read_text())


def test_pair_is_committed_as_specified():
    """Sizes, parameter counts and training specs are those train_model.py describes (else: retrain)."""
    size = sum(f.stat().st_size for path in PAIR_PATHS for f in path.iterdir())
    assert size <= BUDGET_BYTES
    target, draft = _spec(TARGET), _spec(DRAFT)
    assert 9e6 < target["num_parameters"] < 11e6 and 1e6 < draft["num_parameters"] < 2e6
    for path, spec in ((TARGET, target), (DRAFT, draft)):
        assert spec["train"] == asdict(train_model.PAIR[path.name]) and spec["seed"] == 0
        assert spec["measured"]["heldout_perplexity"] > 1
        assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    # The draft is distilled from exactly the committed target's weights.
    assert draft["teacher"] == {"name": TARGET.name, "sha256": distill.weights_sha256(TARGET)}
    assert draft["distill"] == asdict(distill.DISTILL) and draft["measured"]["heldout_greedy_agreement"] > 0.6


def test_pair_shares_tokenizer_and_vocabulary():
    from transformers import AutoConfig, AutoTokenizer

    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    target, draft = AutoTokenizer.from_pretrained(TARGET), AutoTokenizer.from_pretrained(DRAFT)
    assert target.get_vocab() == draft.get_vocab()
    sizes = {len(target), AutoConfig.from_pretrained(TARGET).vocab_size, AutoConfig.from_pretrained(DRAFT).vocab_size}
    assert sizes == {8192}
    assert target(PROMPT)["input_ids"] == draft(PROMPT)["input_ids"]
    assert target.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


@pytest.mark.parametrize("path", PAIR_PATHS, ids=lambda p: p.name)
def test_pair_loads_in_transformers(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("path", PAIR_PATHS, ids=lambda p: p.name)
def test_serval_greedy_equals_transformers(path):
    """Exact token equality, float32 both (Serval's engine on CPU, tiny max_model_len)."""
    from engine import SamplingParams

    reference = HFReference(str(path))
    prompt_ids = reference.tokenizer(PROMPT)["input_ids"]
    expected = reference.greedy(prompt_ids, MAX_TOKENS)
    with make_llm(str(path), max_model_len=128, max_num_seqs=2) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        output = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    assert list(output.token_ids) == expected
    if path == TARGET:  # trained, not random: the continuation is mostly words (identifiers, English)
        text = reference.tokenizer.decode(expected)
        letters = sum(len(word) for word in re.findall(r"[A-Za-z]{2,}", text))
        assert letters >= 0.5 * len("".join(text.split())), text


def _tiny_run(seed: int, steps: int = 4, loss_fn=None):
    config = build_config("llama", "tiny", "float32", tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(7)
    windows = torch.randint(5, config.vocab_size, (16, 32), generator=gen)
    spec = dataclasses.replace(train_model.PAIR[train_model.DRAFT_NAME], size="tiny", steps=steps, warmup=2)
    with train_model.deterministic_cpu():
        model, losses = train_model.train_lm(config, windows, spec, seed, quiet=True, loss_fn=loss_fn)
    return model, losses


def _tiny_teacher():
    """A frozen tiny 'target' (random weights, seed 5): distillation only needs some fixed distribution."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    teacher = AutoModelForCausalLM.from_config(build_config("llama", "tiny", "float32"), dtype=torch.float32)
    return teacher.eval().requires_grad_(False)


def test_training_is_deterministic_to_the_bit():
    first_model, first = _tiny_run(seed=0)
    again_model, again = _tiny_run(seed=0)
    _, other = _tiny_run(seed=1)
    assert first == again and first != other
    for (name, a), (_, b) in zip(first_model.state_dict().items(), again_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert first[-1] < first[0]  # it learns (the same few windows come back)


def test_distillation_is_deterministic_to_the_bit():
    teacher = _tiny_teacher()
    before = {name: t.clone() for name, t in teacher.state_dict().items()}
    first_model, first = _tiny_run(seed=0, loss_fn=distill.DistillLoss(teacher))
    again_model, again = _tiny_run(seed=0, loss_fn=distill.DistillLoss(teacher))
    _, other = _tiny_run(seed=1, loss_fn=distill.DistillLoss(teacher))
    assert first == again and first != other
    for (name, a), (_, b) in zip(first_model.state_dict().items(), again_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert first[-1] < first[0]  # the KL shrinks: the draft moves towards the teacher
    assert all(torch.equal(t, before[name]) for name, t in teacher.state_dict().items())  # frozen


def test_distillation_loss_is_the_kl_then_mixes_in_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    draft, target = torch.randn(2, 3, 5, 11, generator=gen)
    batch = torch.randint(0, 11, (3, 5), generator=gen)
    assert distill.distillation_loss(target, target, batch).abs() < 1e-6  # KL(p || p) = 0
    log_p, log_q = target.log_softmax(-1), draft.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    assert distill.distillation_loss(draft, target, batch) == pytest.approx(kl.item(), rel=1e-5)
    ce = torch.nn.functional.cross_entropy(draft[:, :-1].reshape(-1, 11), batch[:, 1:].reshape(-1))
    half = distill.distillation_loss(draft, target, batch, distill.DistillSpec(kd_weight=0.5))
    assert half == pytest.approx(0.5 * kl.item() + 0.5 * ce.item(), rel=1e-5)


def test_schedule_warms_up_then_decays_to_the_floor():
    spec = train_model.PAIR[train_model.TARGET_NAME]
    lrs = [train_model.lr_at(step, spec) for step in range(spec.steps)]
    assert lrs[0] == spec.lr / spec.warmup and max(lrs) == pytest.approx(spec.lr)
    assert lrs[-1] == pytest.approx(spec.lr * spec.min_lr_ratio, rel=1e-3)
    assert all(a >= b for a, b in zip(lrs[spec.warmup :], lrs[spec.warmup + 1 :]))


def test_batch_order_visits_every_window_once_per_epoch():
    order = train_model.batch_order(10, steps=5, batch_size=4, seed=3)
    assert order.shape == (5, 4)
    assert sorted(order.flatten()[:10].tolist()) == list(range(10))
    assert torch.equal(order, train_model.batch_order(10, steps=5, batch_size=4, seed=3))


def test_held_out_windows_are_the_stream_tail():
    stream = torch.arange(10, 10 + 2000)
    train, held = train_model.split_windows(stream, seq_len=11)
    assert (train[:, 0] == BOS_ID).all() and (held[:, 0] == BOS_ID).all()
    assert held[0, 1].item() == 10 + 2000 - 100  # the last 5%
    assert train[:, 1:].max() < held[:, 1:].min()

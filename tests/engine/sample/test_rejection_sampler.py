"""RejectionSampler: greedy exactness, statistical losslessness, seeding, logprobs, edge cases."""

from __future__ import annotations

import pytest
import torch

from engine.sample import Sampler, SamplingMetadata, make_generator
from engine.sample.rejection_sampler import RejectionSampler
from engine.sampling_params import SamplingParams

EOS = 0
GREEDY = SamplingParams(temperature=0)
RANDOM = SamplingParams(temperature=1.0)


def spec_rows(params, drafts, prompt=(), output=(), generator=None):
    """A request's metadata rows: row j has seen its outputs plus its first j drafts."""
    return [(params, list(prompt), list(output) + list(drafts[:j]), generator) for j in range(len(drafts) + 1)]


def judge(logits, requests, draft_probs=None, num_logprobs=None, bad_words=None):
    """``requests``: (params, drafts[, prompt, output, generator]) per request; ``bad_words``
    (token ids, shared by all rows)."""
    rows = [row for r in requests for row in spec_rows(*r)]
    row_bad_words = None if bad_words is None else [bad_words] * len(rows)
    meta = SamplingMetadata.from_requests(rows, logits.shape[1], EOS, bad_words_token_ids=row_bad_words)
    drafts = [list(r[1]) for r in requests]
    return RejectionSampler()(logits, [len(d) for d in drafts], drafts, draft_probs, meta, num_logprobs)


def greedy_reference(logits, params, prompt, k):
    """Plain greedy decoding with the Sampler, one row per step (row j after tokens 0..j-1)."""
    tokens: list[int] = []
    for j in range(k + 1):
        meta = SamplingMetadata.from_requests([(params, prompt, list(tokens), None)], logits.shape[1], EOS)
        tokens.append(Sampler()(logits[j : j + 1], meta).sampled_token_ids.item())
    return tokens


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_accepts_exactly_the_matching_prefix(mixed):
    """Request m agrees with the argmax for its first m drafts only; ``mixed`` puts a random
    request with its own draft probabilities after each greedy one."""
    torch.manual_seed(0)
    k, vocab = 4, 64
    greedy_logits = torch.randn(k + 1, k + 1, vocab)
    best = greedy_logits.argmax(-1)
    blocks, requests, probs = [], [], []
    for m in range(k + 1):
        drafts = best[m, :k].tolist()
        if m < k:
            drafts[m] = (drafts[m] + 1) % vocab
        blocks.append(greedy_logits[m])
        requests.append((GREEDY, drafts))
        probs.append(torch.rand(k, vocab))  # a greedy request ignores its q
        if mixed:
            blocks.append(torch.randn(3, vocab))
            requests.append((RANDOM, [7, 8]))
            probs.append(torch.softmax(torch.randn(2, vocab), -1))
    logits = torch.cat(blocks)
    before = logits.clone()
    out = judge(logits, requests, torch.cat(probs) if mixed else None)
    assert torch.equal(logits, before)
    step = 2 if mixed else 1
    assert out.num_accepted[::step] == list(range(k + 1))
    for m in range(k + 1):
        assert out.token_ids[m * step] == best[m, : m + 1].tolist()
    assert out.logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.5),
        SamplingParams(temperature=0, logit_bias={3: 2.5, 9: 1.5}),
        SamplingParams(temperature=0, allowed_token_ids=[2, 5, 7, 11, 13], frequency_penalty=2.0),
    ],
)
def test_greedy_with_masks_and_penalties_matches_plain_greedy_decoding(params):
    torch.manual_seed(1)
    k, vocab, prompt = 5, 16, [3, 4, 4]
    # One strong token everywhere: penalties and masks must move the argmax to matter.
    logits = torch.randn(k + 1, vocab) * 0.5
    logits[:, 4] += 2.0
    logits[:, 3] += 1.0
    reference = greedy_reference(logits, params, prompt, k)
    assert reference != logits.argmax(-1).tolist()  # the processing changes the outcome
    out = judge(logits, [(params, reference[:k], prompt)])
    assert out.token_ids == [reference] and out.num_accepted == [k]
    for m in range(k):  # a wrong draft at position m: the reference up to m, then stop
        drafts = list(reference[:k])
        drafts[m] = next(t for t in range(vocab) if t != reference[m])
        out = judge(logits, [(params, drafts, prompt)])
        assert out.token_ids == [reference[: m + 1]] and out.num_accepted == [m]


# ---------------------------------------------------------------- losslessness


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The processed target written out by hand: top-k of logits / T, softmax."""
    scaled = logits / temperature
    kept = torch.full_like(scaled, float("-inf"))
    top = scaled.topk(top_k)
    kept[top.indices] = top.values
    return kept.softmax(-1)


def run_lossless(params, k, num_requests, point_mass, vocab=12, seed=0):
    """Targets p_j fixed per position, drafts drawn i.i.d. from q_j near p_j; returns (p, output, q)."""
    torch.manual_seed(seed)
    # Point-mass drafts pass with probability p(d) only: a sharper target keeps later positions sampled.
    target_logits = torch.randn(k + 1, vocab) * (3.0 if point_mass else 1.5)
    top_k = params.top_k if params.top_k > 0 else vocab
    p = torch.stack([expected_probs(row, params.temperature, top_k) for row in target_logits])
    draft_q = 0.6 * p[:k] + 0.4 * torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    if point_mass:  # like an n-gram proposer, mostly the likeliest token
        draft_q = 0.5 * draft_q + 0.5 * torch.nn.functional.one_hot(p[:k].argmax(-1), vocab)
    drafts = torch.stack([torch.multinomial(draft_q[j], num_requests, replacement=True) for j in range(k)], dim=1)
    logits = target_logits.repeat(num_requests, 1)
    draft_probs = None if point_mass else draft_q.repeat(num_requests, 1)
    return p, judge(logits, [(params, d) for d in drafts.tolist()], draft_probs), draft_q


def histogram(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab).float() / max(len(tokens), 1)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize(
    "params, k",
    [(RANDOM, 1), (RANDOM, 3), (SamplingParams(temperature=0.7, top_k=6), 2)],
)
def test_emitted_tokens_follow_the_target_distribution(params, k, point_mass):
    """Token j of every request that got that far is distributed as p_j (j = k: the bonus)."""
    num_requests, vocab = 20000, 12
    p, out, draft_q = run_lossless(params, k, num_requests, point_mass, vocab)
    assert 0 < sum(out.num_accepted) < k * num_requests  # both branches ran
    assert all(1 <= len(t) <= k + 1 and len(t) == m + 1 for t, m in zip(out.token_ids, out.num_accepted))
    for j in range(k + 1):
        tokens = [t[j] for t in out.token_ids if len(t) > j]
        assert len(tokens) > 1000
        empirical, small = histogram(tokens, vocab), histogram(tokens[:500], vocab)
        # Nearby wrong answers: some of p's mass moved to uniform, or half of it to the draft's q.
        references = [0.85 * p[j] + 0.15 / vocab] + ([0.5 * p[j] + 0.5 * draft_q[j]] if j < k else [])
        assert tv(empirical, p[j]) < tv(small, p[j])  # closer with more samples
        assert all(tv(empirical, p[j]) < tv(empirical, r) for r in references)
        assert tv(empirical, p[j]) < 3.0 * (vocab / len(tokens)) ** 0.5 / 2  # a few standard errors
        if params.top_k > 0:
            assert empirical[p[j] == 0].sum() == 0  # tokens top-k dropped never appear


# ---------------------------------------------------------------- seeding


def seeded_tokens(before, after, seed, logits_a, drafts_a, draft_q_a=None):
    """Request A (seeded) between other random requests ``(drafts, generator)``; A's tokens."""
    vocab = logits_a.shape[1]
    requests = [(RANDOM, d, [], [], g) for d, g in before]
    requests += [(RANDOM, drafts_a, [], [], make_generator(seed))]
    requests += [(RANDOM, d, [], [], g) for d, g in after]
    logits = [torch.randn(len(d) + 1, vocab) for d, _ in before] + [logits_a]
    logits += [torch.randn(len(d) + 1, vocab) for d, _ in after]
    draft_probs = None
    if draft_q_a is not None:
        q = [torch.softmax(torch.randn(len(d), vocab), -1) for d, _ in before] + [draft_q_a]
        draft_probs = torch.cat(q + [torch.softmax(torch.randn(len(d), vocab), -1) for d, _ in after])
    return judge(torch.cat(logits), requests, draft_probs).token_ids[len(before)]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_seeded_request_is_reproducible_whatever_the_batch(with_draft_probs):
    torch.manual_seed(3)
    vocab, k = 8, 3
    logits_a = torch.randn(k + 1, vocab) * 0.3  # flat: acceptances and rejections both likely
    drafts_a = [1, 2, 3]
    q = torch.softmax(torch.randn(k, vocab), -1) if with_draft_probs else None
    results = set()
    for seed in range(6):
        alone = seeded_tokens([], [], seed, logits_a, drafts_a, q)
        batches = [
            ([([4, 5], None)], [([1], make_generator(seed + 100)), ([], None)]),
            ([([], make_generator(99)), ([6, 6, 6, 6], None)], []),
        ]
        for before, after in batches:
            assert seeded_tokens(before, after, seed, logits_a, drafts_a, q) == alone
        results.add(tuple(alone))
    assert len(results) > 1  # the seed matters


def test_no_drafts_draws_exactly_like_the_sampler():
    torch.manual_seed(4)
    vocab = 50
    params = [RANDOM, SamplingParams(temperature=0.8, top_p=0.9), GREEDY, RANDOM]
    logits = torch.randn(len(params), vocab)
    for seeded in (False, True):
        gens = [make_generator(10 + i) if seeded and i % 2 else None for i in range(len(params))]
        rows = [(p, [], [], g) for p, g in zip(params, gens)]
        meta = SamplingMetadata.from_requests(rows, vocab, EOS)
        torch.manual_seed(5)
        expected = Sampler()(logits, meta).sampled_token_ids.tolist()
        gens = [make_generator(10 + i) if seeded and i % 2 else None for i in range(len(params))]
        torch.manual_seed(5)
        out = judge(logits, [(p, [], [], [], g) for p, g in zip(params, gens)])
        assert out.token_ids == [[t] for t in expected] and out.num_accepted == [0] * len(params)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_per_emitted_token_and_cut_per_request():
    torch.manual_seed(6)
    vocab, k = 20, 3
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, presence_penalty=1.0, logprobs=-1),
    ]
    logits = torch.randn(len(params) * (k + 1), vocab)
    greedy_best = logits.argmax(-1).view(len(params), k + 1)
    drafts = [[1, 2, 3], greedy_best[1, :2].tolist() + [0], [4, 4, 4], greedy_best[3, :1].tolist() + [5, 6]]
    out = judge(logits, list(zip(params, drafts, [[7]] * 4)), num_logprobs=[p.logprobs for p in params])
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for i, (p, tokens) in enumerate(zip(params, out.token_ids)):
        if p.logprobs is None:
            continue
        lists = out.logprobs[i]
        width = vocab + 1 if p.logprobs == -1 else p.logprobs + 1
        assert len(lists.token_ids) == len(tokens) == len(lists.ranks)
        for j, token in enumerate(tokens):
            row = raw[i * (k + 1) + j]
            assert lists.token_ids[j][0] == token and len(lists.token_ids[j]) == width
            assert lists.logprobs[j][0] == pytest.approx(row[token].item(), abs=1e-6)
            assert lists.ranks[j] == 1 + int((row > row[token]).sum())
            assert lists.token_ids[j][1:] == row.topk(width - 1).indices.tolist()
    assert out.num_accepted[1] >= 2 and out.num_accepted[3] >= 1  # greedy drafts matched


def test_logprobs_need_the_per_request_counts():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="num_logprobs"):
        judge(logits, [(SamplingParams(logprobs=2), [1])])


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forbidden_draft_is_always_rejected(temperature, with_draft_probs):
    torch.manual_seed(7)
    vocab, n = 10, 400
    params = SamplingParams(temperature=temperature, allowed_token_ids=[2, 3, 4])
    logits = torch.zeros(2 * n, vocab)
    logits[:, 6] = 5.0  # the draft is the raw favourite, but not allowed
    q = torch.zeros(n, vocab)
    q[:, 6] = 0.9
    q[:, 2] = 0.1
    out = judge(logits, [(params, [6])] * n, q if with_draft_probs else None)
    assert out.num_accepted == [0] * n
    assert {t[0] for t in out.token_ids} <= {2, 3, 4}
    if temperature > 0:
        assert len({t[0] for t in out.token_ids}) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masks_see_the_drafts_before_each_position(temperature):
    """Bad words and min_tokens count the earlier drafts as output."""
    torch.manual_seed(8)
    params = SamplingParams(temperature=temperature, min_tokens=3)
    logits = torch.full((4, 10), -5.0)  # each row's favourite holds ~0.9996 of the mass
    logits[0, 5] = logits[1, 6] = logits[2, EOS] = logits[3, 1] = 5.0
    logits[1, 2] = logits[2, 3] = 0.0  # the next best
    # Draft 1 completes the bad word [5, 6].
    out = judge(logits, [(params, [5, 6, EOS], [], [9])], bad_words=[[5, 6]])
    assert out.num_accepted == [1] and out.token_ids[0][0] == 5 and out.token_ids[0][1] != 6
    # EOS as draft 2: banned while 0 outputs + 2 drafts < min_tokens, allowed after 1 + 2.
    out = judge(logits, [(params, [5, 6, EOS])])
    assert out.num_accepted == [2] and out.token_ids[0][2] != EOS
    out = judge(logits, [(params, [5, 6, EOS], [], [9])])
    assert out.num_accepted == [3] and out.token_ids[0][:3] == [5, 6, EOS]
    if temperature == 0:
        assert out.token_ids[0][3] == 1


def test_shapes_are_checked():
    logits = torch.randn(3, 8)
    meta = SamplingMetadata.from_requests([(RANDOM, [], [], None)] * 3, 8, EOS)
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler()(logits, [1], [[2]], None, meta)
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(logits, [2], [[2, 3]], torch.ones(1, 8), meta)

"""``serval make-model PATH --train``: train a small Llama target on the Python stdlib, distil its draft.

What: two Llama checkpoints sharing one byte-level BPE tokenizer (8192 ids,
:mod:`serval.tools.tokenizer_trainer`), for speculative decoding demos and
acceptance-rate benchmarks (random weights accept almost nothing and write
noise). ``PATH/serval-llama-10m`` is the target (make-model's ``10m`` preset:
hidden 256, 8 layers, 4 heads / 2 KV heads, untied: 10.0M parameters);
``PATH/serval-llama-draft`` the draft (``draft`` preset: hidden 128, 2 layers,
tied: 1.42M). Both are saved in bfloat16 (about 23 MB together).

Corpus: :func:`~serval.tools.tokenizer_trainer.stdlib_corpus` (the top-level
stdlib ``*.py`` sources, sorted) with a cap of ``LM_CORPUS_CHARS`` instead of
the tokenizer's 2M characters: the whole top-level stdlib (4.7M characters,
about 1.2M tokens on CPython 3.11.7), whose first 2M characters are exactly the
tokenizer's corpus. Each file is encoded without special tokens and followed
by EOS; the stream is split into the first 95% (training) and the last 5%
(held out, 60k tokens, never trained on). Both are cut into 255-token windows
with BOS in front (serving prompts start with BOS too).

Schedule: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warmup
then cosine decay to 10% of the peak, gradient clipping at 1.0, batches of 8
windows (2048 tokens), ``TrainSpec.steps`` steps (360: 0.64 epoch of the 4490 training windows).
The target trains on next-token cross-entropy. The draft, made after it, is distilled from the saved
target (:mod:`serval.tools.distill`: KL(target || draft) on the target's next-token distributions)
on the very same batches, in the same order; ``--draft-only`` remakes only the draft from an
existing target.

Determinism: float32 on CPU with ``torch.set_num_threads(2)`` and
``torch.use_deterministic_algorithms``; weights initialised after
``torch.manual_seed(seed)``; the window order is a ``torch.randperm`` from
its own seeded generator. Same Python install + same seed: same loss bits
(tests/serval/test_trained_models.py checks it on a tiny config).

Both models are undertrained, so greedy text is repetitive Python-shaped words; the distilled draft
matches the target's greedy next token far more often than one trained on the corpus. Run times,
held-out perplexities and acceptance rates: docs/design-measurements.md and assets/trained/README.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Passive OpenMP waits: on a shared machine a spinning torch thread starves its descheduled partner, and
# 2-thread training slows down by several times while another job holds one core. libgomp
# reads this when torch loads, so it only takes effect when torch is not imported yet (as in ``serval``).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from serval.tools.checkpoint import is_complete, mark_complete, write_skeleton  # noqa: E402

TARGET_NAME = "serval-llama-10m"
DRAFT_NAME = "serval-llama-draft"
LM_CORPUS_CHARS = 5_000_000  # more than the whole top-level stdlib (4.7M characters)
HOLDOUT_FRACTION = 0.05
SEQ_LEN = 256  # BOS + 255 corpus tokens
THREADS = 2
PROGRESS_S = 5.0
EVAL_BATCH = 16
TRAIN_SPEC_VERSION = 1


@dataclass(frozen=True)
class TrainSpec:
    """One model's shape (a make-model size preset) and its optimisation schedule."""

    size: str
    tie_word_embeddings: bool
    steps: int
    lr: float
    batch_size: int = 8
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0


PAIR: dict[str, TrainSpec] = {
    TARGET_NAME: TrainSpec(size="10m", tie_word_embeddings=False, steps=360, lr=2e-3),
    DRAFT_NAME: TrainSpec(size="draft", tie_word_embeddings=True, steps=360, lr=3e-3),
}


@contextlib.contextmanager
def deterministic_cpu(threads: int = THREADS):
    """Run the body with ``threads`` torch threads and deterministic algorithms; restore both after."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def keep_freed_memory() -> None:
    """Have glibc keep freed large blocks for reuse instead of unmapping them (process-wide; results unchanged).

    Why: a distillation step allocates and frees about 0.9 GB in 64 MB logit tensors; by default glibc
    serves each from a fresh mmap, and every page faults in again, a large share of each
    step's time. A no-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: up to 1 GiB from the heap, not mmap
    mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: keep up to 2 GiB of freed heap mapped


def encode_corpus(tokenizer_file: Path, max_chars: int = LM_CORPUS_CHARS) -> torch.Tensor:
    """The stdlib corpus as one token stream: each file's ids (no special tokens), then EOS."""
    from tokenizers import Tokenizer

    from serval.tools.tokenizer_trainer import EOS_ID, stdlib_corpus

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(stdlib_corpus(max_chars), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def split_windows(stream: torch.Tensor, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) windows of ``seq_len`` tokens, BOS first; held out = the stream's last 5%."""
    n_held = int(len(stream) * HOLDOUT_FRACTION)
    return _windows(stream[:-n_held], seq_len), _windows(stream[-n_held:], seq_len)


def _windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    from serval.tools.tokenizer_trainer import BOS_ID

    body = seq_len - 1
    rows = stream[: len(stream) // body * body].view(-1, body)
    return torch.cat([torch.full((len(rows), 1), BOS_ID, dtype=torch.long), rows], dim=1)


def batch_order(n_windows: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """``(steps, batch_size)`` window indices: seeded permutations, one per epoch, concatenated."""
    gen = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    epochs = [torch.randperm(n_windows, generator=gen) for _ in range(math.ceil(needed / n_windows))]
    return torch.cat(epochs)[:needed].view(steps, batch_size)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup over ``spec.warmup`` steps, then cosine from ``spec.lr`` to ``min_lr_ratio * lr``."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    floor = spec.min_lr_ratio
    return spec.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model, spec: TrainSpec) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # norms
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


def train_lm(
    config, windows: torch.Tensor, spec: TrainSpec, seed: int, label: str = "", quiet: bool = False, loss_fn=None
):
    """Train a fresh float32 causal LM for ``config`` on ``windows``; return ``(model, per-step losses)``.

    ``loss_fn(model, batch)``: the objective (default: next-token cross-entropy; the draft's is
    :class:`serval.tools.distill.DistillLoss`). Deterministic in (config, windows, spec, seed,
    loss_fn); call inside :func:`deterministic_cpu`.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    optimizer = _optimizer(model, spec)
    order = batch_order(len(windows), spec.steps, spec.batch_size, seed)
    losses: list[float] = []
    start = last_print = time.monotonic()
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        batch = windows[order[step]]
        loss = model(input_ids=batch, labels=batch).loss if loss_fn is None else loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.monotonic()
        if not quiet and (now - last_print >= PROGRESS_S or step + 1 == spec.steps):
            last_print = now
            _progress(label, step + 1, spec, losses, now - start)
    return model.eval(), losses


def _progress(label: str, done: int, spec: TrainSpec, losses: list[float], elapsed: float) -> None:
    rate = done * spec.batch_size * SEQ_LEN / elapsed
    eta = elapsed / done * (spec.steps - done)
    recent = sum(losses[-10:]) / len(losses[-10:])  # the mean of the last 10 steps: less noisy
    print(
        f"  {label}: step {done}/{spec.steps}  loss {recent:.3f}  lr {lr_at(done - 1, spec):.2e}  "
        f"{rate:.0f} tok/s  elapsed {elapsed:.0f}s  ETA {eta:.0f}s",
        flush=True,
    )


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) over every predicted position of ``windows``."""
    total, count = 0.0, 0
    for start in range(0, len(windows), EVAL_BATCH):
        batch = windows[start : start + EVAL_BATCH]
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def _spec(name: str, seed: int) -> dict:
    """What a trained checkpoint is deterministic in (compared by make-model's up-to-date check)."""
    return {
        "spec_version": TRAIN_SPEC_VERSION,
        "trained": name,
        "seed": seed,
        "train": asdict(PAIR[name]),
        "corpus": f"stdlib_corpus({LM_CORPUS_CHARS}), last {HOLDOUT_FRACTION:.0%} of tokens held out",
        "seq_len": SEQ_LEN,
        "python": sys.version.split()[0],
        "torch": torch.__version__.split("+")[0],
    }


def _save(model, path: Path, spec: dict, measured: dict) -> None:
    """Write ``model``'s weights (bfloat16) and config next to the tokenizer files; the spec file last."""
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(path)
    for weights in path.glob("*.safetensors"):
        os.chmod(weights, 0o644)  # safetensors creates files as 0600
    mark_complete(path, {**spec, "num_parameters": model.num_parameters(), "measured": measured})


def _train_one(paths: dict[str, Path], name: str, config, seed: int, data, quiet: bool) -> dict:
    """Train (the draft: distil from the saved target), round to bfloat16, evaluate and save one model."""
    from serval.tools.distill import DistillLoss, greedy_agreement, load_teacher, teacher_spec

    teacher = load_teacher(paths[TARGET_NAME]) if name == DRAFT_NAME else None
    loss_fn = None if teacher is None else DistillLoss(teacher)
    start = time.monotonic()
    model, losses = train_lm(config, data[0], PAIR[name], seed, label=name, quiet=quiet, loss_fn=loss_fn)
    train_s = time.monotonic() - start
    model.to(torch.bfloat16).to(torch.float32)  # evaluate exactly the weights that are saved
    ppl = perplexity(model, data[1])
    measured = {
        "train_seconds": round(train_s, 1),
        "final_train_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),  # the draft's: the KL
        "heldout_perplexity": round(ppl, 3),
        "heldout_tokens": int(data[1][:, 1:].numel()),
    }
    spec = _spec(name, seed)
    if teacher is not None:
        measured["heldout_greedy_agreement"] = round(greedy_agreement(model, teacher, data[1]), 4)
        spec.update(teacher_spec(paths[TARGET_NAME]))
    _save(model, paths[name], spec, measured)
    if not quiet:
        print(f"serval make-model --train: {name} held-out {measured} -> {paths[name]}", flush=True)
    return measured


def _stale(paths: dict[str, Path], seed: int, force: bool, draft_only: bool) -> list[str]:
    """The models to (re)make, in order: a new target always takes a new draft with it."""
    from serval.tools.distill import teacher_spec

    target_ok = is_complete(paths[TARGET_NAME], _spec(TARGET_NAME, seed))
    if draft_only and not target_ok:
        raise FileNotFoundError(f"--draft-only: {paths[TARGET_NAME]} holds no up-to-date target (seed {seed})")
    if not draft_only and (force or not target_ok):
        return [TARGET_NAME, DRAFT_NAME]
    draft_spec = {**_spec(DRAFT_NAME, seed), **teacher_spec(paths[TARGET_NAME])}
    return [DRAFT_NAME] if force or not is_complete(paths[DRAFT_NAME], draft_spec) else []


def train_pair(
    root, seed: int = 0, force: bool = False, quiet: bool = False, draft_only: bool = False
) -> dict[str, Path]:
    """Train (target, draft) into ``root/serval-llama-10m`` and ``root/serval-llama-draft``; return both paths.

    The target first, then the draft distilled from it (:mod:`serval.tools.distill`). Skips a model whose
    directory already holds a checkpoint with the same spec, unless ``force``. ``draft_only``: never touch
    the target (it must be up to date), (re)make just the draft from it. Both get the same tokenizer files
    (make-model's, for 8192 ids).
    """
    root = Path(root)
    paths = {name: root / name for name in PAIR}
    todo = _stale(paths, seed, force, draft_only)
    if not todo:
        if not quiet:
            print(f"serval make-model --train: {root} already up to date (seed {seed})")
        return paths
    start = time.monotonic()
    keep_freed_memory()
    configs = {
        name: write_skeleton(paths[name], "llama", PAIR[name].size, "float32", PAIR[name].tie_word_embeddings, 0)
        for name in todo
    }
    with deterministic_cpu():
        data = split_windows(encode_corpus(paths[todo[0]] / "tokenizer.json"))
        if not quiet:
            print(f"serval make-model --train: {len(data[0])} training windows, {len(data[1])} held out", flush=True)
        for name in todo:
            _train_one(paths, name, configs[name], seed, data, quiet)
    if not quiet:
        print(f"serval make-model --train: done in {time.monotonic() - start:.0f}s", flush=True)
    return paths

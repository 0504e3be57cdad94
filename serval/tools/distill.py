"""Knowledge distillation of the draft from the trained target (``serval make-model PATH --train``).

Why: speculative decoding accepts a draft token only where it equals what the target would emit, so
the draft should imitate the target, not the corpus. Trained independently on the same corpus, the
pair agrees on far fewer held-out greedy next tokens than a distilled pair; distilled, the draft learns
the target's whole next-token distribution at every position (a far richer signal than one label per position).

Loss: ``kd_weight * KL(target || draft) + (1 - kd_weight) * CE(corpus)``, the KL over every window
position (float32, temperature 1; the mean over positions of the sum over the vocabulary). The target
runs in eval mode under ``torch.no_grad`` on the very batches, in the same order, that train_model.py's
schedule draws for the draft (same seed, same :func:`~serval.tools.train_model.batch_order`). The
target is always the saved bfloat16 checkpoint loaded in float32 (right after it was trained, or an
existing one with ``--draft-only``), so both paths distill from the same weights and give the same
draft bits; the draft's spec records the target's weights hash (a retrained target makes it stale).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

EVAL_BATCH = 16


@dataclass(frozen=True)
class DistillSpec:
    """The distillation objective: ``kd_weight`` of KL(target || draft), the rest plain next-token loss."""

    kd_weight: float = 1.0
    temperature: float = 1.0


DISTILL = DistillSpec()


def load_teacher(path: Path):
    """The saved target at ``path`` as a frozen float32 model in eval mode."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    teacher.requires_grad_(False)
    return teacher


def weights_sha256(path: Path) -> str:
    """sha256 over ``path``'s safetensors files (sorted by name): what a distilled draft depends on."""
    digest = hashlib.sha256()
    for weights in sorted(Path(path).glob("*.safetensors")):
        digest.update(weights.read_bytes())
    return digest.hexdigest()


def teacher_spec(teacher_path: Path, spec: DistillSpec = DISTILL) -> dict:
    """The spec entries that make a draft stale when the objective or the target's weights change."""
    return {
        "distill": asdict(spec),
        "teacher": {"name": Path(teacher_path).name, "sha256": weights_sha256(teacher_path)},
    }


def distillation_loss(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, batch: torch.Tensor, spec: DistillSpec = DISTILL
) -> torch.Tensor:
    """``kd_weight * KL(target || draft) + (1 - kd_weight) * CE``; logits ``(B, T, V)``, ``batch`` ``(B, T)`` ids.

    KL at temperature ``spec.temperature`` (scaled by T**2, so its gradient size does not depend on T),
    averaged over all B*T positions; CE is the usual shifted next-token loss.
    """
    vocab = draft_logits.shape[-1]
    t = spec.temperature
    log_q = torch.log_softmax(draft_logits.reshape(-1, vocab) / t, dim=-1)
    log_p = torch.log_softmax(target_logits.reshape(-1, vocab) / t, dim=-1)
    kl = torch.nn.functional.kl_div(log_q, log_p, reduction="batchmean", log_target=True) * (t * t)
    if spec.kd_weight == 1.0:
        return kl
    ce = torch.nn.functional.cross_entropy(draft_logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1))
    return spec.kd_weight * kl + (1 - spec.kd_weight) * ce


class DistillLoss:
    """``train_lm``'s loss function for a draft: the distillation loss against a frozen ``teacher``."""

    def __init__(self, teacher, spec: DistillSpec = DISTILL):
        self.teacher, self.spec = teacher, spec

    def __call__(self, model, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target_logits = self.teacher(input_ids=batch).logits
        return distillation_loss(model(input_ids=batch).logits, target_logits, batch, self.spec)


@torch.no_grad()
def greedy_agreement(draft, target, windows: torch.Tensor) -> float:
    """Fraction of the predicted positions of ``windows`` where draft and target argmax agree.

    The positions are those perplexity counts (all but each window's last); a proxy for greedy
    speculative-decoding acceptance.
    """
    same, count = 0, 0
    for start in range(0, len(windows), EVAL_BATCH):
        batch = windows[start : start + EVAL_BATCH]
        draft_ids = draft(input_ids=batch).logits[:, :-1].argmax(-1)
        target_ids = target(input_ids=batch).logits[:, :-1].argmax(-1)
        same += int((draft_ids == target_ids).sum())
        count += draft_ids.numel()
    return same / count

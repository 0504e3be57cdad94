"""Sampling parameters with vLLM's field names and semantics.

Pure Python (the engine core imports it): no torch here. Every field is
validated at construction; a bad value raises ValueError naming the field, so
the serving layer can turn it into a 400 without touching the engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields, replace

# Temperatures below this sample greedily (vLLM's threshold); dividing by them would overflow.
GREEDY_TEMPERATURE = 1e-5


class RequestKind(enum.Enum):
    """What a request produces, declared by its params (``SamplingParams.kind``, ``PoolingParams.kind``): the
    engine dispatches on it (the scheduler finishes, the model runner samples or pools, the front end outputs)."""

    GENERATE = "generate"  # sampled tokens (vLLM's runner "generate")
    EMBED = "embed"  # one vector pooled from the prompt's final hidden states (vLLM's task "embed")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


# The constraint kinds of ``StructuredOutputsParams``, in the order the grammar cache keys them.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's ``StructuredOutputsParams``): exactly one kind is set.

    ``json``: a JSON schema (a dict, or its text); ``regex``: the output fully matches it; ``choice``:
    the output is one of these strings; ``grammar``: an EBNF (GBNF) grammar whose ``root`` rule the
    output matches; ``json_object``: any JSON object; ``structural_tag``: xgrammar's structural tag
    (JSON text), which tool calls use. ``disable_any_whitespace`` makes JSON compact (no whitespace
    between tokens), whatever the engine's default; None keeps the engine's
    (``structured_outputs_config.disable_any_whitespace``).

    Checked here: one kind, the right types, nothing empty, the schema is JSON. Whether the
    backend can compile it is checked by the front end before the request is queued.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        kinds = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None]
        _check(
            len(kinds) == 1,
            f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
            f"{', '.join(kinds) if kinds else 'none'}.",
        )
        self._validate_value(kinds[0])

    def _validate_value(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            _check(
                isinstance(value, (dict, str)), "structured_outputs.json must be a JSON schema (an object or its text)."
            )
            if isinstance(value, str):
                try:
                    _check(isinstance(json.loads(value), dict), "structured_outputs.json must be a JSON object.")
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
        elif kind == "choice":
            _check(len(value) > 0, "structured_outputs.choice must not be empty.")
            _check(all(isinstance(c, str) for c in value), "structured_outputs.choice must be a list of strings.")
        elif kind == "json_object":
            _check(value is True, "structured_outputs.json_object must be true when given.")
        else:
            _check(isinstance(value, str) and value != "", f"structured_outputs.{kind} must be a non-empty string.")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (a schema as compact JSON, choices as a JSON list): the grammar cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            # Not sorted: the schema's property order is the output's.
            return json.dumps(json.loads(value) if isinstance(value, str) else value)
        if self.kind == "choice":
            return json.dumps(value)
        return "" if self.kind == "json_object" else value

    @classmethod
    def from_dict(cls, values: dict) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object; an unknown key is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        _check(not unknown, f"structured_outputs has unknown field(s): {', '.join(unknown)}.")
        return cls(**values)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion (vLLM's ``SamplingParams``).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k.
    ``max_tokens=None`` means "up to the model's context length". ``logprobs``
    and ``prompt_logprobs`` ask for that many top alternatives per position
    (the sampled / actual token is always included on top of them).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    # ``bad_words`` as token-id sequences, filled in by the front end (``Processor.make_request``) so
    # that workers ban ids without ever loading a tokenizer; None until then.
    bad_words_token_ids: list[list[int]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Accept the loose input types vLLM accepts, store one canonical form.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif self.stop is None:
            object.__setattr__(self, "stop", [])
        else:
            object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        object.__setattr__(self, "bad_words", list(self.bad_words or []))
        if self.bad_words_token_ids is not None:
            object.__setattr__(self, "bad_words_token_ids", [list(word) for word in self.bad_words_token_ids])
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", list(self.allowed_token_ids))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        self._validate()

    def _validate(self) -> None:
        """Raises ValueError for the first bad field: how tokens are drawn, then lengths and token constraints."""
        self._validate_sampling()
        self._validate_lengths_and_tokens()

    def _validate_sampling(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
        )
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
        )
        _check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")

    def _validate_lengths_and_tokens(self) -> None:
        _check(
            self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}."
        )
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}.")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
        )
        _check(
            self.logprobs is None or self.logprobs >= -1,
            f"logprobs must be non-negative or -1 (whole vocabulary), got {self.logprobs}.",
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= -1,
            f"prompt_logprobs must be non-negative or -1 (whole vocabulary), got {self.prompt_logprobs}.",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers.",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        _check(all(isinstance(w, str) and w for w in self.bad_words), "bad_words must be non-empty strings.")
        _check(
            self.logit_bias is None or all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
            "logit_bias values must be in [-100, 100].",
        )
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty."
        )

    @property
    def kind(self) -> RequestKind:
        return RequestKind.GENERATE

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes) -> SamplingParams:
        """A copy with some fields changed (used to fan out ``n`` > 1)."""
        return replace(self, **changes)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)

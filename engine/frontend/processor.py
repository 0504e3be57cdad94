"""Turns user input (text or token ids plus SamplingParams) into engine-core Requests.

All validation that can be done before a request touches the engine happens
here and raises ValueError, so a bad request is refused without disturbing
the ones already running.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping

from engine.config import EngineConfig
from engine.inputs import PLAIN_REQUEST, PromptType, RequestOptions
from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sample.masks import tokenize_bad_words
from engine.sample.metadata import validate_token_ids
from engine.sampling_params import RequestKind, SamplingParams
from engine.sched.request import Request, check_prompt_fits

# The runner (ModelConfig.runner) that serves each request kind; "auto" serves both.
RUNNERS = {RequestKind.GENERATE: "generate", RequestKind.EMBED: "pooling"}


class Processor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids: list[int], arch=None) -> None:
        self.config = config
        self.arch = arch  # the model's Architecture: LoRA adapters are checked against it
        self._checked_loras: dict[int, str] = {}  # adapter id -> path, each adapter read and checked once
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        # Further EOS ids (checkpoints may list several) stop generation like stop tokens.
        self.extra_stop_token_ids = eos_token_ids[1:]

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text if given, token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(
            f"A prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}."
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # The core trusts what it is sent (it may be another process): every check on a request runs here,
        # but the empty prompt, which Request itself refuses.
        self._check_vocabulary(prompt_token_ids)
        if params.stop and not params.detokenize:
            raise ValueError("Stop strings need detokenize=True (they are matched in the text).")
        validate_token_ids(params, self.vocab_size)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids contains ids outside the vocabulary: {bad_stop[:8]}.")
        check_prompt_fits(len(prompt_token_ids), self.max_model_len)
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)

    def _check_vocabulary(self, prompt_token_ids: list[int]) -> None:
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"The prompt contains token ids outside the vocabulary (size {self.vocab_size}): {bad[:8]}."
            )

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        """The constraint builds (xgrammar's reason otherwise), and nothing else decides where the output ends."""
        from engine.structured_output.backend import check_constraint

        if params.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the grammar decides where the output ends."
            )
        check_constraint(params.structured_outputs, self.config.structured_outputs_config)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> Request:
        """The core's request of ``params.kind``, ``options`` carried whole into it; raises ValueError on bad
        input, or on a kind the engine's ``runner`` does not serve."""
        self._check_runner(params.kind)
        if options.lora_request is not None:
            self.validate_lora(options.lora_request)
        if params.kind is RequestKind.EMBED:
            self.validate_pooling(prompt_token_ids, params, options)
            return Request(
                request_id,
                prompt_token_ids,
                None,
                self.eos_token_id,
                priority=options.priority,
                arrival_time=time.time(),
                cache_salt=options.cache_salt,  # the blocks it computes are cached under its salt
                lora_request=options.lora_request,
                pooling_params=params,
            )
        self.validate(prompt_token_ids, params)
        if params.bad_words and params.bad_words_token_ids is None:
            # Workers ban token ids and never load a tokenizer: the words become ids here, once.
            params = params.clone(bad_words_token_ids=tokenize_bad_words(params.bad_words, self.tokenizer))
        if self.extra_stop_token_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=list(params.stop_token_ids) + self.extra_stop_token_ids)
        return Request(
            request_id,
            prompt_token_ids,
            params,
            self.eos_token_id,
            priority=options.priority,
            arrival_time=time.time(),
            cache_salt=options.cache_salt,
            kv_transfer_params=options.kv_transfer_params,
            lora_request=options.lora_request,
        )

    def _check_runner(self, kind: RequestKind) -> None:
        runner = self.config.model_config.runner
        if runner != "auto" and runner != RUNNERS[kind]:
            what = "embeddings" if kind is RequestKind.EMBED else "generation"
            raise ValueError(f"This model serves no {what}: it runs with runner={runner!r}.")

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams, options: RequestOptions) -> None:
        """A pooling request's prompt fits the context (it adds no token) and the model allows its
        ``dimensions`` (vLLM's Matryoshka rule); it moves no KV."""
        self._check_vocabulary(prompt_token_ids)
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"The prompt has {len(prompt_token_ids)} tokens, but max_model_len is {self.max_model_len}."
            )
        if options.kv_transfer_params:
            raise ValueError("A pooling request moves no KV: kv_transfer_params are for generation.")
        if params.dimensions is None:
            return
        arch = self.arch
        if not arch.is_matryoshka:
            raise ValueError(
                f"The model {self.config.model_config.model!r} does not support Matryoshka representations: "
                "its vector cannot be cut to other dimensions (its config.json declares no matryoshka_dimensions)."
            )
        allowed = arch.matryoshka_dimensions
        if (allowed is not None and params.dimensions not in allowed) or params.dimensions > arch.hidden_size:
            raise ValueError(
                f"dimensions must be one of {list(allowed or ())} (the model's matryoshka_dimensions), at most "
                f"hidden_size ({arch.hidden_size}); got {params.dimensions}."
            )

    def validate_lora(self, lora_request: LoRARequest) -> None:
        """The adapter is readable, well formed and fits the model and ``max_lora_rank`` (ValueError naming
        what is wrong); an id keeps the path and contents it was first checked with."""
        lora_config = self.config.lora_config
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        if not lora_config.enable_lora:
            raise ValueError("This engine serves no LoRA adapters: start it with enable_lora=True.")
        source = (lora_request.lora_path, lora_request.content_digest)
        known = self._checked_loras.get(lora_request.lora_int_id)
        if known == source:
            return
        if known is not None:
            raise ValueError(
                f"LoRA id {lora_request.lora_int_id} already names the adapter at {known[0]!r} (as it was then)."
            )
        import torch

        from engine.lora.adapter import load_adapter

        load_adapter(lora_request.lora_path, self.arch, lora_config.max_lora_rank, torch.float32)
        self._checked_loras[lora_request.lora_int_id] = source


def _as_token_ids(token_ids) -> list[int]:
    """``prompt_token_ids`` as a list of ints; anything but integers (floats, a string) is a ValueError."""
    if not isinstance(token_ids, (str, bytes)):
        try:
            return [operator.index(t) for t in token_ids]
        except TypeError:
            pass
    raise ValueError(f"prompt_token_ids must be a sequence of integer token ids, got {token_ids!r:.80}.")

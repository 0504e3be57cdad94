"""OpenAI request models, with vLLM's extra sampling fields.

Field names, defaults and bounds follow the OpenAI API and vLLM's server.
Unknown fields are accepted and ignored (as vLLM does), with a debug log.
Cross-field rules that OpenAI rejects (``suffix``, ``stream_options``
without ``stream``, ...) raise here, so they surface as pydantic errors -> 400.
The output-constraint fields come from ``structured.py``, the chat tool fields
from ``tool_calls.py``, chat messages from ``chat_messages.py``; response
models live in ``responses.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import Field, field_validator, model_validator

from engine.entrypoints.openai.chat_messages import ChatMessage
from engine.entrypoints.openai.protocol_base import OpenAIBaseModel
from engine.entrypoints.openai.structured import StructuredOutputFields
from engine.entrypoints.openai.tool_calls import ToolFields, ToolList
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs, and vLLM's default max_logprobs
MAX_N = 128  # completions per prompt one request may ask for
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_object(body: bytes) -> dict:
    """The request body as a JSON object; raises ValueError (-> 400) on anything else.

    Its strings must be text: a ``"\\ud800"`` escape decodes to a lone surrogate, which no tokenizer
    takes (Hugging Face's raised a TypeError, answered 500).
    """
    try:
        data = json.loads(body)
        if _SURROGATE_ESCAPE.search(body):  # only an escape yields one: UTF-8 cannot encode a surrogate
            json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"The request body holds a string that is not valid Unicode: {exc.reason}.") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder recurses once per nested array or object
        raise ValueError("The request body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise ValueError("The request body must be a JSON object.")
    return data


# The sampling fields a request may leave unset -> OpenAI's (and vLLM's) value when the model has no default.
UNSET_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(StructuredOutputFields):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras, then the constraint's)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = 0

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    @property
    def is_usage_streamed(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What constrains the output (``structured.StructuredOutputFields``); ValueError (-> 400) on a bad one."""
        return self.structured_outputs_params()

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] = MappingProxyType({}),
    ) -> SamplingParams:
        """The engine's parameters; raises ValueError (-> 400) on a bad value.

        ``defaults`` (SamplingParams' names: the model's generation config, ``sampling_defaults``) fill the
        sampling fields the request left unset; OpenAI's defaults fill the rest."""

        logit_bias = None
        if self.logit_bias is not None:
            try:
                logit_bias = {int(token_id): bias for token_id, bias in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings).") from None
        return SamplingParams(
            n=self.n,
            **{
                name: value if (value := getattr(self, name)) is not None else defaults.get(name, fallback)
                for name, fallback in UNSET_SAMPLING_DEFAULTS.items()
            },
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            bad_words=self.bad_words or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.output_constraint(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


PromptInput = list[int] | list[list[int]] | str | list[str]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch (strings or token ids)."""

    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, prompt: Any) -> Any:
        return check_prompt_input(prompt, "prompt")

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.suffix is not None:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n).")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch: a list of texts or a list of token-id lists (one element for a single prompt)."""
        return prompt_batch(self.prompt, "prompt")


def check_prompt_input(value: Any, name: str) -> Any:
    """``value`` if it is a ``PromptInput``, else ValueError: one clear message instead of pydantic's error per
    union member (completions' ``prompt``, embeddings' ``input``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and (
        all(isinstance(item, str) for item in value)
        or all(_is_token_id(item) for item in value)
        or all(isinstance(item, list) and all(map(_is_token_id, item)) for item in value)
    ):
        return value
    raise ValueError(
        f"{name} must be a string, a list of strings, a list of token ids (integers) or a list of token-id lists."
    )


def prompt_batch(value: PromptInput, name: str) -> list[str] | list[list[int]]:
    """A ``PromptInput`` as a batch: a list of texts or of token-id lists (one element for a single prompt)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ValueError(f"{name} must not be empty.")
    if isinstance(value[0], int):
        return [value]
    return list(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatTemplateFields(ToolList):
    """How messages (and the tools they may call) become a prompt (chat completions and chat tokenize share them)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already holds the special tokens
    chat_template: str | None = None  # vLLM's: a Jinja template for this request, in place of the model's
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_prompt_mode(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        return self

    def conversation(self) -> list[dict[str, Any]]:
        return [message.template_dict() for message in self.messages]


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields, ToolFields):
    """``POST /v1/chat/completions``."""

    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content (the content stays without it)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true.")
        return self

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The request's own constraint, or the one a required / named ``tool_choice`` imposes (not both)."""
        tool_constraint = self.tool_constraint()
        extra = [] if tool_constraint is None else [(f"tool_choice ({self.tool_mode})", tool_constraint)]
        return self.structured_outputs_params(extra)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for SamplingParams (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """``POST /tokenize`` with ``messages``: the chat template's rendering, tokenized."""

    model: str | None = None
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's ``POST /v1/load_lora_adapter``; ``model``: which served model (needed when several are served)."""

    lora_name: str
    lora_path: str
    model: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter``; ``model`` as for loading."""

    lora_name: str
    model: str | None = None

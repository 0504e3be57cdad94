"""A request's output constraint: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and the older ``guided_*`` fields, turned into one
``StructuredOutputsParams``.

Every source is read; more than one constraint at once is a ValueError (-> 400)
naming them, and a field Serval cannot honour (``guided_whitespace_pattern``,
another decoding backend) is refused rather than ignored, so a request a client
believes constrained never runs unconstrained.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import Field, model_validator

from engine.entrypoints.openai.protocol_base import OpenAIBaseModel
from engine.sampling_params import StructuredOutputsParams

# The decoding backends a request may name (vLLM's ``guided_decoding_backend``): Serval has xgrammar only.
_BACKENDS = (None, "auto", "xgrammar")


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: a named schema (``strict`` is accepted: the schema is always enforced)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``, plus vLLM's ``structural_tag`` type (xgrammar's structural tag, as is)."""

    model_config = OpenAIBaseModel.model_config | {"extra": "allow"}  # a structural tag's own fields

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema.")
        return self

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_)
        if self.type == "structural_tag":
            return StructuredOutputsParams(structural_tag=self.model_dump_json(exclude={"json_schema"}))
        return None


class StructuredOutputFields(OpenAIBaseModel):
    """The constraint fields completions and chat share; :meth:`structured_outputs_params` combines them."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    @model_validator(mode="after")
    def _check_unsupported_guidance(self):
        if self.guided_whitespace_pattern is not None:
            raise ValueError(
                "guided_whitespace_pattern is not supported; set structured_outputs.disable_any_whitespace "
                "to true for compact JSON instead."
            )
        if self.guided_decoding_backend not in _BACKENDS:
            raise ValueError(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; Serval decodes "
                "structured outputs with xgrammar."
            )
        return self

    def constraint_sources(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Each field that asks for a constraint, with the constraint it asks for."""
        sources = []
        if self.response_format is not None and (params := self.response_format.to_params()) is not None:
            sources.append((f"response_format ({self.response_format.type})", params))
        if self.structured_outputs is not None and set(self.structured_outputs) != {_WHITESPACE}:
            sources.append(("structured_outputs", _from_structured_outputs(self.structured_outputs)))
        for name, kind in _GUIDED_FIELDS:
            if getattr(self, name) is not None:
                sources.append((name, StructuredOutputsParams(**{kind: getattr(self, name)})))
        return sources

    def structured_outputs_params(
        self, extra_sources: list[tuple[str, StructuredOutputsParams]] = ()
    ) -> StructuredOutputsParams | None:
        """The one constraint this request asks for (its fields' and ``extra_sources``), or None.

        A ValueError (-> 400) names the sources when there are several. ``structured_outputs`` holding only
        ``disable_any_whitespace`` modifies whichever constraint the other fields give (a tool call's too).
        """
        sources = [*self.constraint_sources(), *extra_sources]
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise ValueError(f"Only one output constraint may be given per request; this one has {names}.")
        whitespace = (self.structured_outputs or {}).get(_WHITESPACE)
        if not sources:
            if whitespace is not None:
                raise ValueError(
                    "structured_outputs.disable_any_whitespace needs a constraint (a structured_outputs kind, "
                    "response_format, guided_* or a required / named tool_choice)."
                )
            return None
        params = sources[0][1]
        if whitespace is not None and params.disable_any_whitespace is None:
            params = dataclasses.replace(params, disable_any_whitespace=whitespace)
        return params


_WHITESPACE = "disable_any_whitespace"
_GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def _from_structured_outputs(values: dict[str, Any]) -> StructuredOutputsParams:
    # vLLM clients send structural_tag as an object as often as as its JSON text.
    if isinstance(values.get("structural_tag"), dict):
        values = {**values, "structural_tag": json.dumps(values["structural_tag"])}
    return StructuredOutputsParams.from_dict(values)

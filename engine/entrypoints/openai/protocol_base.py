"""The base of every OpenAI request model (``protocol.py`` and the modules its fields come from)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger("engine.entrypoints.openai.protocol")


class OpenAIBaseModel(BaseModel):
    """Unknown fields are accepted and ignored (as vLLM does), with a debug log naming them."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields) - _aliases(cls))
            if unknown:
                logger.debug("%s: ignoring unknown fields %s", cls.__name__, unknown)
        return data


def _aliases(cls: type[BaseModel]) -> set[str]:
    return {field.alias for field in cls.model_fields.values() if field.alias}

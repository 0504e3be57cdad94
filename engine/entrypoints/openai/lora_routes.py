"""The HTTP side of multi-LoRA: which served model a request's ``model`` goes to when it names an adapter, the
``/v1/models`` list with each model's adapters, and vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (the model's server holds the adapters: ``lora_models.LoRAModels``).

A router (``api_server.ModelRouter``) answers ``adapter_cards(model_id)``; the handlers here take
``(router, raw_request)`` like ``api_server``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.errors import (
    ErrorResponse,
    bad_request,
    error_response,
    from_exception,
    from_validation_error,
    make_error,
    model_not_found,
)
from engine.entrypoints.openai.lora_models import split_adapter
from engine.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse_json_object
from engine.entrypoints.openai.responses import ModelCard


async def resolve_model(router: Any, model: str | None) -> str | ErrorResponse:
    """The served model id a request's ``model`` goes to: the model itself, ``"<model id>:<adapter>"``'s model,
    or, for an adapter's own name, the model serving it (with one model served, that model, whose server answers
    404 unless it holds such an adapter). None: the only model served (400 when several are)."""
    model_ids = router.model_ids()
    if model is None:
        if len(model_ids) == 1:
            return model_ids[0]
        return bad_request(f"The request has no `model`; this server serves {model_ids}.", param="model")
    if model in model_ids:
        return model
    split = split_adapter(model, model_ids)
    if split is not None:
        return split[0]
    if len(model_ids) == 1:
        return model_ids[0]
    for model_id in model_ids:
        with contextlib.suppress(Exception):  # a model whose servers do not answer holds nothing we can use
            cards = await router.adapter_cards(model_id)
            if any(card.id in (model, f"{model_id}:{model}") for card in cards):
                return model_id
    return model_not_found(model)


async def model_cards(router: Any) -> list[ModelCard]:
    """Every served model's ``/v1/models`` entry followed by its adapters'."""
    model_ids = router.model_ids()
    bases, adapters = await asyncio.gather(
        asyncio.gather(*(router.model_card(model_id) for model_id in model_ids)),
        asyncio.gather(*(router.adapter_cards(model_id) for model_id in model_ids)),
    )
    cards = []
    for base, its_adapters in zip(bases, adapters, strict=True):
        cards += [base, *its_adapters]
    return cards


async def handle_load_lora_adapter(router: Any, raw_request: Request) -> Response:
    """vLLM's ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``): 200 with vLLM's text, or 400."""
    return await _adapter_call(router, raw_request, Endpoint.LOAD_LORA_ADAPTER, LoadLoRAAdapterRequest)


async def handle_unload_lora_adapter(router: Any, raw_request: Request) -> Response:
    """vLLM's ``POST /v1/unload_lora_adapter`` (``lora_name``): 200 with vLLM's text, or 404 / 400."""
    return await _adapter_call(router, raw_request, Endpoint.UNLOAD_LORA_ADAPTER, UnloadLoRAAdapterRequest)


async def _adapter_call(router: Any, raw_request: Request, endpoint: Endpoint, model: type[BaseModel]) -> Response:
    try:
        request = model.model_validate(parse_json_object(await raw_request.body()))
    except ValidationError as exc:
        return error_response(from_validation_error(exc))
    except ValueError as exc:
        return error_response(bad_request(str(exc)))
    model_id = request.model
    if model_id is None and len(router.model_ids()) == 1:
        [model_id] = router.model_ids()
    if model_id not in router.model_ids():
        if model_id is None:
            return error_response(bad_request(f"Name the `model`; this server serves {router.model_ids()}."))
        return error_response(model_not_found(model_id))
    try:
        async with contextlib.aclosing(router.call(model_id, endpoint, request)) as items:
            answer = await anext(items)
    except StopAsyncIteration:
        answer = make_error("The model server returned no response.", HTTPStatus.INTERNAL_SERVER_ERROR)
    except Exception as exc:  # noqa: BLE001 - e.g. a replica that died
        answer = from_exception(exc)
    if isinstance(answer, ErrorResponse):
        return error_response(answer)
    return PlainTextResponse(answer.message)

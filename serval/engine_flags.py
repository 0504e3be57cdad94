"""The engine's arguments as command-line flags, generated from ``EngineArgs`` (vLLM's ``--max-model-len`` style).

Every ``EngineArgs`` field but ``model`` and ``kv_transfer_config`` is a flag ``--field-name`` with the
field's type (a nested config as JSON), choices and description, so a knob added to ``engine/config.py``
is a flag of ``serval serve`` and ``serval bench throughput`` / ``latency`` without another declaration.
A flag left out stays None:
``EngineArgs``' own default applies, and pydantic checks the bounds (its error names the field).
``--engine-kwargs JSON`` takes any field as well; the flags win.
"""

from __future__ import annotations

import argparse
import json
import types
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# model: the positional argument (or --model); kv_transfer_config: a disaggregated app sets it per pool.
NOT_FLAGS = frozenset({"model", "kv_transfer_config"})


def engine_flag_names(exclude: frozenset[str] = frozenset()) -> list[str]:
    """The ``EngineArgs`` fields that are flags, in ``EngineArgs``' order, less ``exclude``."""
    from engine.engine_args import EngineArgs

    return [name for name in EngineArgs.model_fields if name not in NOT_FLAGS | exclude]


def add_engine_flags(group, exclude: frozenset[str] = frozenset()) -> None:
    """Adds one flag per ``engine_flag_names(exclude)`` and ``--engine-kwargs`` to ``group`` (a parser or group)."""
    from engine.engine_args import EngineArgs

    for name in engine_flag_names(exclude):
        group.add_argument(f"--{name.replace('_', '-')}", **flag_options(EngineArgs.model_fields[name]))
    group.add_argument(
        "--engine-kwargs",
        type=json_object,
        default={},
        metavar="JSON",
        help="any other EngineArgs fields as a JSON object; the flags above take precedence",
    )


def engine_kwargs_from_flags(args: argparse.Namespace, exclude: frozenset[str] = frozenset()) -> dict:
    """``--engine-kwargs`` overlaid with the flags that were given (those left out are not keys)."""
    given = {name: getattr(args, name) for name in engine_flag_names(exclude) if getattr(args, name) is not None}
    return {**args.engine_kwargs, **given}


def flag_options(info: FieldInfo) -> dict:
    """``add_argument`` options for one field: bool -> --x/--no-x, Literal -> choices, tuple -> several values."""
    kind = _without_none(info.annotation)
    if kind is bool:
        options: dict = {"action": argparse.BooleanOptionalAction}
    elif typing.get_origin(kind) is typing.Literal:
        options = {"choices": list(typing.get_args(kind))}
    elif typing.get_origin(kind) in (tuple, list):
        options = {"type": typing.get_args(kind)[0], "nargs": "+"}
    elif kind in (int, float, str):
        options = {"type": kind}
    elif isinstance(kind, type) and issubclass(kind, BaseModel):  # a nested config: vLLM's JSON form
        options = {"type": json_object, "metavar": "JSON"}
    else:
        raise TypeError(f"EngineArgs field of type {kind!r} has no command-line form; add one here")
    help_text = info.description or ""
    if info.default is not None and info.default is not PydanticUndefined:
        help_text += f" (default: {info.default})"
    return {**options, "default": None, "help": help_text.replace("%", "%%")}  # argparse formats help with %


def json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _without_none(annotation):
    """``int | None`` -> ``int``; anything else as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation

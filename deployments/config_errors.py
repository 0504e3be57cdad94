"""A serve config's problem as one line: the YAML path of the key, what is wrong, and the nearest valid key.

    applications[0].args.llm_configs[0].engine_kwargs.max_num_seq: unknown key; did you mean max_num_seqs?
    applications[0].args.llm_configs[0].engine_kwargs.max_num_seqs: expected an integer, got 'many'

``validated`` is the one check of an app builder's ``args``: the builders call it (Serve shows the line as the
app's DEPLOY_FAILED message: ``ConfigError`` is a ``RayServeException``, whose message Serve reports without
a traceback) and so does the command line before it starts or joins a cluster (``serve_config``).

pydantic's report is turned into that line here: validator and union-member names leave the path, a union
alternative that does not apply (a string where a mapping was given) is dropped, and an unknown key gets the
closest declared one (``difflib``). Free-form mappings checked against another vocabulary (``engine_kwargs``:
``EngineArgs``; ``deployment_config``: Serve's options) name it with ``KeysOf`` in their annotation.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, RootModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ErrorType
from ray.serve.exceptions import RayServeException

M = TypeVar("M", bound=BaseModel)
EXPECTED = {  # pydantic's type-error kinds -> what a YAML author writes
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean (true or false)",
    "string": "a string",
    "dict": "a mapping",
    "model": "a mapping",
    "list": "a list",
    "tuple": "a list",
}
MAX_LISTED_KEYS = 12  # an unknown key with no close match lists the valid ones when they are this few
MAX_INPUT_CHARS = 60
_KNOWN_KINDS = frozenset(typing.get_args(ErrorType))


class ConfigError(RayServeException, ValueError):
    """One problem of a serve config, its message one line: ``<YAML path>: <what is wrong>``.

    ``validation_error``: pydantic's full report, for ``serval --debug``.
    """

    def __init__(self, line: str, validation_error: ValidationError | None = None) -> None:
        super().__init__(line)
        self.line = line
        self.validation_error = validation_error


@dataclass(frozen=True)
class KeysOf:
    """Annotation metadata of a free-form mapping whose keys another check holds to a vocabulary:
    ``keys()`` maps each valid key to its value's annotation (or ``FieldInfo``)."""

    keys: Callable[[], dict[str, Any]]
    where_listed: str = ""  # where a user finds the valid keys, said when none is close to an unknown one

    @classmethod
    def model(cls, model: type[BaseModel], where_listed: str = "") -> KeysOf:
        return cls(lambda: dict(model.model_fields), where_listed)


def validated(model: type[M], data: Any, where: str = "args") -> M:
    """``model.model_validate(data)``; raises ``ConfigError`` whose line names the first problem's path
    under ``where`` (the YAML path of ``data``)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(one_line(error, model, where), error) from None


def from_file(load: Callable[[str], M], model: type[M], path: str, index: int) -> M:
    """``load(path)`` (a ``model``) for the list item ``index`` that names a file; a problem in the file (a key,
    YAML, no such file) is raised at that item, naming the file and, for a key, its path in the file."""
    try:
        return load(path)
    except (ValidationError, OSError, yaml.YAMLError) as error:
        problem = one_line(error, model) if isinstance(error, ValidationError) else str(error).splitlines()[0]
        details = {"type": "value_error", "loc": (index,), "input": path, "ctx": {"error": f"{path}: {problem}"}}
        raise ValidationError.from_exception_data("file", [details]) from None


def under(error: ValidationError, *loc: str | int) -> ValidationError:
    """``error`` with each problem's location put under ``loc``: raised in a validator, a nested model's
    error is reported at the validated field, so its own path (``request_router_kwargs.x``) is given here."""
    details = []
    for item in error.errors(include_url=False):
        kind: Any = item["type"]
        if kind not in _KNOWN_KINDS:  # a custom error: its message as it was rendered
            kind = PydanticCustomError(kind, item["msg"].replace("{", "{{").replace("}", "}}"))
        detail = {"type": kind, "loc": (*loc, *item["loc"]), "input": item.get("input")}
        if item.get("ctx") and isinstance(kind, str):  # a known kind renders its message from its context
            detail["ctx"] = item["ctx"]
        details.append(detail)
    return ValidationError.from_exception_data(error.title, details)


def one_line(error: ValidationError, model: type[BaseModel], where: str = "") -> str:
    """The first problem of ``error`` (raised validating ``model``) as one line, its path under ``where``."""
    problems = [_Problem.of(item, model) for item in error.errors(include_url=False)]
    kept = [p for p in problems if not any(other.explains(p) for other in problems if other is not p)]
    kept.sort(key=lambda p: p.kind != "extra_forbidden")  # a typo also makes the key it meant "missing"
    first = kept[0]
    alternatives = [p for p in kept if p.path == first.path and p.is_type_error()]
    if first.is_type_error() and len(alternatives) > 1:  # the value fits no member of a union
        expected = " or ".join(dict.fromkeys(p.expected() for p in alternatives))
        return f"{_join(where, first.path)}: expected {expected}, got {_shown(first.input)}"
    text = "; ".join(line.strip() for line in first.text().splitlines() if line.strip())  # a validator's, too
    return f"{_join(where, first.path)}: {text}"


@dataclass
class _Problem:
    """One of pydantic's errors, its location as the YAML path."""

    kind: str
    path: tuple[str | int, ...]
    message: str
    input: Any
    context: dict[str, Any]
    valid_keys: dict[str, Any] | None  # at an unknown key: the keys its mapping takes
    where_listed: str  # and where they are listed, if said

    @classmethod
    def of(cls, item: dict[str, Any], model: type[BaseModel]) -> _Problem:
        path, keys, listed = _clean(item["loc"], model, item["type"] == "extra_forbidden")
        return cls(item["type"], path, item["msg"], item.get("input"), item.get("ctx") or {}, keys, listed)

    def is_type_error(self) -> bool:
        return self.kind.endswith(("_type", "_parsing"))

    def explains(self, other: _Problem) -> bool:
        """Whether this problem makes ``other`` moot: it lies deeper under the same key (``other`` is a union
        alternative that was not meant), or ``other`` is a type mismatch of another alternative here."""
        if len(self.path) > len(other.path):
            return self.path[: len(other.path)] == other.path
        return self.path == other.path and other.is_type_error() and not self.is_type_error()

    def expected(self) -> str:
        return EXPECTED.get(self.kind.rsplit("_", 1)[0], self.message.removeprefix("Input should be ").split(",")[0])

    def text(self) -> str:
        if self.kind == "extra_forbidden":
            return "unknown key" + suggestion(str(self.path[-1]), list(self.valid_keys or ()), self.where_listed)
        if self.kind == "missing":
            return "missing (a required key)"
        if self.kind in ("value_error", "assertion_error"):
            return self.message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if self.is_type_error():
            return f"expected {self.expected()}, got {_shown(self.input)}"
        text = f"{self.message.removeprefix('Input ')}, got {_shown(self.input)}"
        if self.kind == "literal_error" and isinstance(self.input, str):
            match = difflib.get_close_matches(self.input, re.findall(r"'([^']*)'", self.context.get("expected", "")), 1)
            text += f"; did you mean {match[0]}?" if match else ""
        return text


def suggestion(key: str, valid: list[str], where_listed: str) -> str:
    """The nearest valid key, else the valid keys when few, else how many there are and where they are listed."""
    match = difflib.get_close_matches(key, valid, n=1)
    if match:
        return f"; did you mean {match[0]}?"
    if valid and len(valid) <= MAX_LISTED_KEYS:
        return f" (valid: {', '.join(valid)})"
    listed = f"; {where_listed}" if where_listed else ""
    return f" (none of the {len(valid)} valid keys is close{listed})" if valid else ""


def _clean(loc: tuple, model: type[BaseModel], last_is_key: bool) -> tuple[tuple, dict | None, str]:
    """pydantic's location as the YAML path (no validator or union-member tags), and the valid keys of the
    mapping holding its last key, with where they are listed."""
    spec: Any = model
    path: list[str | int] = []
    keys: dict[str, Any] | None = None
    listed = ""
    for index, part in enumerate(loc):
        if isinstance(part, int):  # an item of a list: the same spec
            path.append(part)
            continue
        keys, listed = _keys(spec), getattr(_marker(spec), "where_listed", "")
        is_last = index == len(loc) - 1
        if keys is not None and part in keys:
            spec = keys[part]
        elif keys is not None and not (is_last and last_is_key):
            continue  # a tag pydantic adds: function-after[...], a union member's name
        elif _is_tag(part) and not is_last:
            continue
        else:
            spec = Any
        path.append(part)
    return tuple(path), keys, listed


def _is_tag(part: str) -> bool:
    return part.startswith(("function-", "json-or-python", "tagged-union")) or "[" in part


def _keys(spec: Any) -> dict[str, Any] | None:
    """The keys a mapping of ``spec`` (a model, an annotation, a ``FieldInfo``) takes, each with its value's
    spec; None when any key may be there (a free-form dict)."""
    marker = _marker(spec)
    if marker is not None:
        return marker.keys()
    if isinstance(spec, FieldInfo):
        return _keys(spec.annotation)
    if typing.get_origin(spec) is typing.Annotated:
        return _keys(typing.get_args(spec)[0])
    models = models_in(spec)
    if not models:
        return None
    keys: dict[str, Any] = {}
    for found in models:
        nested = _keys(found.model_fields["root"]) if issubclass(found, RootModel) else dict(found.model_fields)
        keys.update(nested or {})
    return keys


def _marker(spec: Any) -> KeysOf | None:
    """The ``KeysOf`` of a field, an ``Annotated`` type or a RootModel's root; None if it has none."""
    if isinstance(spec, type) and issubclass(spec, RootModel):
        spec = spec.model_fields["root"]
    metadata = spec.metadata if isinstance(spec, FieldInfo) else getattr(spec, "__metadata__", ())
    return next((m for m in metadata if isinstance(m, KeysOf)), None)


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation allows (``X | None``, ``Union[str, X]``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, tuple):
        return [model for arg in typing.get_args(annotation) for model in models_in(arg)]
    return []


def _join(where: str, path: tuple[str | int, ...]) -> str:
    text = where
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "the config"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_INPUT_CHARS else text[: MAX_INPUT_CHARS - 3] + "..."

"""A whole Serve config (the file ``serve deploy`` takes), checked as Serve and Serval's app builders will
check it, without a cluster: what ``serval serve`` and ``serval render-rayservice`` run before anything starts.

Serve's own schema first (``ServeDeploySchema``: what ``serve deploy`` checks, and no key it would drop), then
each application whose ``import_path`` is one of Serval's builders gets its ``args`` validated by the
builder's own call (``config_errors.validated``), so the first problem is refused here with the line Serve
would show.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from deployments.config_errors import ConfigError, suggestion, validated
from deployments.llm_config import LLMServingArgs
from deployments.pd_config import PDServingArgs

BUILDER_MODULES = ("deployments.app", "serval.serve")  # serval/serve.py re-exports deployments/app.py's builders
BUILDER_ARGS: dict[str, type[BaseModel]] = {"build_openai_app": LLMServingArgs, "build_pd_openai_app": PDServingArgs}


def builder_args(import_path: str) -> type[BaseModel] | None:
    """The model of the ``args`` a Serval builder named by ``import_path`` takes; None for other apps."""
    module, _, name = str(import_path).replace(":", ".").rpartition(".")
    return BUILDER_ARGS.get(name) if module in BUILDER_MODULES else None


def check_serve_config(config: Any) -> None:
    """Raises ``ConfigError`` (one line: the YAML path, what is wrong) for the first problem of ``config``."""
    if not isinstance(config, dict):
        raise ConfigError(f"the config: expected a mapping (a Serve config), got {type(config).__name__}")
    validated(ServeDeploySchema, config, "")
    refuse_unknown_keys(config, ServeDeploySchema, "")
    for index, app in enumerate(config["applications"]):
        refuse_unknown_keys(app, ServeApplicationSchema, f"applications[{index}].")
        model = builder_args(app.get("import_path", ""))
        if model is not None:
            validated(model, app.get("args") or {}, f"applications[{index}].args")


def refuse_unknown_keys(data: dict, model: type[BaseModel], where: str) -> None:
    """Serve's schemas drop keys they do not know (forward compatibility): a typo there (``http_option``)
    would deploy with the default silently, so here it is refused like any other."""
    for key in data:
        if key not in model.model_fields:
            raise ConfigError(f"{where}{key}: unknown key{suggestion(str(key), list(model.model_fields), '')}")

"""``serval serve <model>`` / ``serval serve --config app.yaml``: serve over the OpenAI API on a Ray cluster,
with ``vllm serve``'s lifecycle.

    serval serve models/tiny-llama --max-model-len 2048 --tensor-parallel-size 2
    serval serve HuggingFaceTB/SmolLM2-135M-Instruct     # from the local Hugging Face cache
    serval serve --config app.yaml                       # any Serve config
    serval serve models/tiny-llama --print-config > my-model.yaml   # the same file goes to helm install

In the foreground (the default) it logs to the terminal and Ctrl-C drains in-flight streams and tears
down what it started (a local Ray head; on a cluster named by ``--address`` / ``RAY_ADDRESS``, or one
already running, only its app); ``--detach`` returns once RUNNING (``serval status``, ``serval stop``).
An app of the same name already running is refused unless ``--replace``.

Engine-argument flags (``EngineArgs`` names, dashed) become the Serve config's ``engine_kwargs``; the
config (``deployments.app:build_openai_app``, one model) is validated like any serve YAML and written to
a file (``serval.launcher.lifecycle`` runs it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from serval.engine_flags import add_engine_flags, engine_kwargs_from_flags
from serval.launcher.options import add_cluster_arguments

SUMMARY = "serve a model over the OpenAI API on a Ray cluster, in the foreground (vllm serve MODEL)"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
OPENAI_BUILDERS = ("build_openai_app", "build_pd_openai_app")  # Serval's app builders: they take api_keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="a local checkpoint directory or .gguf file, or a Hugging Face id (org/name) in the local cache",
    )
    parser.add_argument("--config", metavar="PATH", help="serve this Serve config (YAML) instead of one model")
    parser.add_argument(
        "--served-model-name",
        "--model-id",
        dest="served_model_name",
        help="the name clients pass as `model` (default: the Hugging Face id, or the directory's or file's name)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SERVAL_API_KEY"),
        help="the key clients must send (Authorization: Bearer KEY); default: SERVAL_API_KEY",
    )
    add_engine_flags(parser.add_argument_group("engine (engine_kwargs)"))
    deployment = parser.add_argument_group("deployment (deployment_config)")
    deployment.add_argument("--num-replicas", type=int, default=1)
    deployment.add_argument("--max-ongoing-requests", type=int, default=256)
    deployment.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    deployment.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    http = parser.add_argument_group("endpoint")
    http.add_argument("--host", help=f"where Serve's proxy listens (default: the config's, else {DEFAULT_HOST})")
    http.add_argument("--port", type=int, help=f"Serve's HTTP port (default: the config's, else {DEFAULT_PORT})")
    add_cluster_arguments(parser)
    head = parser.add_argument_group("a local Ray head this command starts")
    head.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule (default: all)")
    head.add_argument("--object-store-bytes", type=int, default=512 * 1024 * 1024)
    head.add_argument("--metrics-export-port", type=int, default=8080, help="the node's Prometheus endpoint")
    life = parser.add_argument_group("lifecycle")
    life.add_argument("--detach", action="store_true", help="return once RUNNING; `serval stop` ends it")
    life.add_argument("--replace", action="store_true", help="replace an app of the same name already running")
    life.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for the app to be RUNNING")
    life.add_argument("--drain-timeout-s", type=float, default=60.0, help="how long in-flight streams may take")
    output = parser.add_argument_group("the Serve config")
    output.add_argument("--print-config", action="store_true", help="print the Serve config and exit")
    output.add_argument("--output", metavar="PATH", help="where to write the config (default: a temporary file)")


def run(args: argparse.Namespace) -> int:
    """Checks the config as the app builder will (a problem: one line, exit code 2, nothing started), then
    serves it (``lifecycle.serve``)."""
    import yaml

    from deployments.config_errors import ConfigError
    from serval.config_check import refuse

    try:
        config, path = _config(args)
    except ConfigError as error:
        return refuse(error, "serval serve", args.config, getattr(args, "debug", False))
    except (ValueError, OSError) as error:  # no model there, no such file
        print(f"serval serve: {error}", file=sys.stderr)
        return 1
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
        return 0
    if path is None:
        path = write_config(yaml.safe_dump(config, sort_keys=False), args.output)
        print(
            f"Serve config: {path} (the same file runs on Kubernetes: "
            f"helm install serval ./helm/serval --set-file serveConfigFile={path})",
            flush=True,
        )
    from serval.launcher import lifecycle

    cluster = lifecycle.plan_cluster(args.address, args.dashboard_port, args.gcs_port, args.metrics_export_port)
    return lifecycle.serve(
        config,
        path,
        cluster,
        detach=args.detach,
        replace=args.replace,
        head_options={"num_cpus": args.num_cpus, "object_store_bytes": args.object_store_bytes},
        timeout_s=args.timeout_s,
        drain_timeout_s=args.drain_timeout_s,
    )


def _config(args: argparse.Namespace) -> tuple[dict, str | None]:
    """The config to serve, checked (``ConfigError``: its first problem), and its file (None: made from the
    flags, not written yet)."""
    from deployments.serve_config import check_serve_config
    from serval.config_check import load_serve_config

    if (args.model is None) == (args.config is None):
        raise ValueError("give a model or --config PATH (one of them)")
    if args.config is None:
        return build_serve_config(args), None
    with open(args.config, encoding="utf-8") as f:
        config = load_serve_config(f.read(), args.config)
    check_serve_config(config)  # the endpoint flags below are typed by argparse
    return with_endpoint_flags(config, args), args.config


def with_endpoint_flags(config: dict, args: argparse.Namespace) -> dict:
    """``config`` with the ``--host`` / ``--port`` / ``--api-key`` that were given (the API key on each app
    of Serval's builders)."""
    http = dict(config.get("http_options") or {})
    http.update({key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None})
    apps = []
    for app in config.get("applications") or []:
        if args.api_key and str(app.get("import_path", "")).rsplit(":", 1)[-1] in OPENAI_BUILDERS:
            app = {**app, "args": {**(app.get("args") or {}), "api_keys": [args.api_key]}}
        apps.append(app)
    return {**config, "http_options": http, "applications": apps}


def build_serve_config(args: argparse.Namespace) -> dict:
    """The one-model Serve config the flags describe, checked as the app builder will check it.

    Raises ``ConfigError`` (one line naming the key) for a bad setting, ``ValueError`` for a missing model.
    """
    from deployments.serve_config import check_serve_config
    from serval.fetch_model import is_hub_id

    actor_options = {"num_cpus": _whole_if_integral(args.num_cpus_per_replica)}
    if args.num_gpus_per_replica:
        actor_options["num_gpus"] = _whole_if_integral(args.num_gpus_per_replica)
    default_name = args.model if is_hub_id(args.model) else Path(args.model).resolve().name.removesuffix(".gguf")
    llm_config = {
        "model_loading_config": {
            "model_id": args.served_model_name or default_name,
            "model_source": model_source(args.model),
        },
        "engine_kwargs": engine_kwargs_from_flags(args),
        "deployment_config": {
            "num_replicas": args.num_replicas,
            "max_ongoing_requests": args.max_ongoing_requests,
            "ray_actor_options": actor_options,
        },
    }
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": DEFAULT_HOST, "port": DEFAULT_PORT},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/",
                "import_path": "deployments.app:build_openai_app",
                "args": {"llm_configs": [llm_config]},
            }
        ],
    }
    config = with_endpoint_flags(config, args)
    check_serve_config(config)
    return config


def model_source(model: str) -> str:
    """``model`` as the config's model_source: a Hugging Face id as its snapshot in the local cache; a path
    relative to the Serval checkout when inside it (the form the Helm chart moves under its models volume),
    else absolute. Serval resolves relative sources against the checkout, not the working directory."""
    from deployments.llm_config import SERVAL_ROOT
    from engine.model.source import open_model_source
    from serval.fetch_model import hub_cache_path, is_hub_id

    if is_hub_id(model):
        model = hub_cache_path(model)  # ValueError saying how to get it
    open_model_source(os.path.expanduser(model))  # ValueError saying what a model is, before any cluster starts
    path = Path(os.path.expanduser(model)).resolve()
    return str(path.relative_to(SERVAL_ROOT)) if path.is_relative_to(SERVAL_ROOT) else str(path)


def write_config(text: str, output: str | None) -> str:
    if output is None:
        handle, output = tempfile.mkstemp(prefix="serval-serve-", suffix=".yaml")
        os.close(handle)
    Path(output).write_text(text, encoding="utf-8")
    return output


def _whole_if_integral(amount: float) -> float | int:
    """1.0 -> 1: the config then reads as one written by hand (``num_cpus: 1``)."""
    return int(amount) if float(amount).is_integer() else amount

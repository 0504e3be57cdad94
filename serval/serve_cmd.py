"""``serval serve <model>``: serve a local checkpoint (a directory or a .gguf file) over the OpenAI API, as
``vllm serve MODEL`` does.

    serval serve models/tiny-llama --max-model-len 2048 --tensor-parallel-size 2
    serval serve models/tiny-llama --print-config > my-model.yaml   # the same file goes to helm install

Engine-argument flags (``EngineArgs`` names, dashed) become the Serve config's ``engine_kwargs``; the
config (``deployments.app:build_openai_app``, one model) is validated like any serve YAML, written to a
file and run the way ``make serve`` runs ``configs/serve/default.yaml`` (``deployments.launcher up``: a
Ray head on 127.0.0.1, the app deployed, RUNNING awaited, the endpoint printed; ``make stop`` ends it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from serval.engine_flags import add_engine_flags, engine_kwargs_from_flags

SUMMARY = "serve a local checkpoint over the OpenAI API on a local Ray cluster (vllm serve MODEL)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="local checkpoint directory or .gguf file (Serval never downloads)")
    parser.add_argument(
        "--model-id", help="the name clients pass as `model` (default: the directory's or .gguf file's name)"
    )
    add_engine_flags(parser.add_argument_group("engine (engine_kwargs)"))
    deployment = parser.add_argument_group("deployment (deployment_config)")
    deployment.add_argument("--num-replicas", type=int, default=1)
    deployment.add_argument("--max-ongoing-requests", type=int, default=256)
    deployment.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    deployment.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    http = parser.add_argument_group("endpoint and cluster")
    http.add_argument("--host", default="127.0.0.1", help="where Serve's proxy listens (default: loopback)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--dashboard-port", type=int, default=8265)
    http.add_argument("--gcs-port", type=int, default=6379)
    http.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for the app to be RUNNING")
    output = parser.add_argument_group("the Serve config")
    output.add_argument("--print-config", action="store_true", help="print the Serve config and exit")
    output.add_argument("--output", metavar="PATH", help="where to write the config (default: a temporary file)")


def run(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    try:
        config = build_serve_config(args)
    except (ValidationError, ValueError) as error:
        print(f"serval serve: {error}", file=sys.stderr)
        return 1
    text = yaml.safe_dump(config, sort_keys=False)
    if args.print_config:
        sys.stdout.write(text)
        return 0
    path = write_config(text, args.output)
    print(
        f"Serve config: {path} (the same file runs on Kubernetes: "
        f"helm install serval ./helm/serval --set-file serveConfigFile={path})",
        flush=True,
    )
    from deployments import launcher

    return launcher.main(
        [
            "up",
            "--config",
            path,
            "--gcs-port",
            str(args.gcs_port),
            "--dashboard-port",
            str(args.dashboard_port),
            "--timeout-s",
            str(args.timeout_s),
        ]
    )


def build_serve_config(args: argparse.Namespace) -> dict:
    """The one-model Serve config the flags describe, checked as the app builder will check it.

    Raises ``ValueError`` (or pydantic's ``ValidationError``, naming the key) for a bad setting.
    """
    from deployments.llm_config import LLMConfig

    actor_options = {"num_cpus": _whole_if_integral(args.num_cpus_per_replica)}
    if args.num_gpus_per_replica:
        actor_options["num_gpus"] = _whole_if_integral(args.num_gpus_per_replica)
    llm_config = {
        "model_loading_config": {
            "model_id": args.model_id or Path(args.model).resolve().name.removesuffix(".gguf"),
            "model_source": model_source(args.model),
        },
        "engine_kwargs": engine_kwargs_from_flags(args),
        "deployment_config": {
            "num_replicas": args.num_replicas,
            "max_ongoing_requests": args.max_ongoing_requests,
            "ray_actor_options": actor_options,
        },
    }
    LLMConfig.model_validate(llm_config)
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": args.host, "port": args.port},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/",
                "import_path": "deployments.app:build_openai_app",
                "args": {"llm_configs": [llm_config]},
            }
        ],
    }


def model_source(model: str) -> str:
    """``model`` as the config's model_source: relative to the Serval checkout when inside it (the form
    the Helm chart moves under its models volume), else absolute. Serval resolves relative sources
    against the checkout, not the working directory."""
    from deployments.llm_config import SERVAL_ROOT
    from engine.model.source import open_model_source

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

"""The ``serval`` command line.

Each subcommand lives in its own module, which exposes ``SUMMARY``,
``add_arguments(parser)`` and ``run(args) -> int``; ``SUBCOMMANDS`` lists
them by command path. Modules keep their heavy imports (torch, ray,
transformers) inside ``run``, so ``serval --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from serval import __version__
from serval.extras import missing_extra

# Command path -> module. A two-word path ("bench serve") is a subcommand of a group.
SUBCOMMANDS = {
    ("make-model",): "serval.tools.make_model",
    ("demo",): "serval.demo",
    ("fetch-model",): "serval.fetch_model",
    ("gguf-to-hf",): "serval.gguf_to_hf",
    ("quantize-gguf",): "serval.tools.quantize_gguf",
    ("serve",): "serval.serve_cmd",
    ("status",): "serval.status_cmd",
    ("stop",): "serval.stop_cmd",
    ("render-rayservice",): "serval.render_rayservice",
    ("bench", "serve"): "serval.bench.serve",
    ("bench", "throughput"): "serval.bench.throughput",
    ("bench", "latency"): "serval.bench.latency",
    ("bench", "tune"): "serval.bench.tune",
    ("bench", "soak"): "serval.bench.soak",
    ("bench", "perplexity"): "serval.bench.perplexity",
    ("dashboard", "push"): "serval.dashboard",
}
GROUP_HELP = {
    "bench": "benchmarks: load-test an endpoint, the offline engine, sweep configurations",
    "dashboard": "Grafana dashboards for Serval's metrics",
}


def _add_subcommand(subparsers, name: str, module_name: str) -> None:
    module = importlib.import_module(module_name)
    parser = subparsers.add_parser(name, help=module.SUMMARY, description=module.SUMMARY)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level ``serval`` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="serval", description="Serval LLM serving on Ray")
    parser.add_argument("--version", action="version", version=f"serval {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the details behind an error (a refused config: pydantic's report)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups = {}
    for path, module_name in SUBCOMMANDS.items():
        if len(path) == 1:
            _add_subcommand(subparsers, path[0], module_name)
            continue
        group_name, name = path
        if group_name not in groups:
            group = subparsers.add_parser(group_name, help=GROUP_HELP[group_name], description=GROUP_HELP[group_name])
            groups[group_name] = group.add_subparsers(dest=f"{group_name}_command", metavar="COMMAND", required=True)
        _add_subcommand(groups[group_name], name, module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    message = missing_extra(args.command)
    if message:
        print(message, file=sys.stderr)
        return 1
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

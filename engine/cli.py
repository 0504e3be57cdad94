"""The ``serval`` command line.

Each subcommand lives in its own module and registers itself through one
``_add_<name>_parser(subparsers)`` function here.  Heavy imports (torch,
transformers) happen only inside the subcommand, so ``serval --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys


def _add_make_model_parser(subparsers) -> None:
    from engine.tools import make_model

    parser = subparsers.add_parser(
        "make-model", help="write a small random-weight HF checkpoint",
        description=make_model.SUMMARY)
    make_model.add_arguments(parser)
    parser.set_defaults(handler=make_model.run)


def _add_demo_parser(subparsers) -> None:
    from engine.tools import demo

    parser = subparsers.add_parser("demo", help=demo.SUMMARY, description=demo.SUMMARY)
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.run)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level ``serval`` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="serval", description="Serval LLM serving engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_make_model_parser(subparsers)
    _add_demo_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

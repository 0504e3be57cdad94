"""The flags of ``serval bench serve``: ``vllm bench serve``'s names and defaults (vLLM's
``vllm/benchmarks/serve.py``), and Serval's older spellings as deprecated aliases.

Where Serval differs from vLLM it says so in the flag's help: ``--endpoint`` defaults to the backend's
path, every latency metric has percentiles, and the JSON is also written when ``--result-dir`` or
``--result-filename`` is given.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from serval.bench.datasets import add_dataset_arguments
from serval.bench.report import METRICS, parse_goodput, parse_metric_names, parse_percentiles, parse_slos
from serval.bench.request_funcs import Backend

SAMPLING_FLAGS = {  # flag -> type; each is sent in every request only when given (vLLM's sampling group)
    "--temperature": float,
    "--top-p": float,
    "--top-k": int,
    "--min-p": float,
    "--frequency-penalty": float,
    "--presence-penalty": float,
    "--repetition-penalty": float,
}


class DeprecatedAlias(argparse.Action):
    """An old Serval spelling: prints a one-line note naming ``use`` and stores into the new flag's ``dest``
    (``extend``: appends to its list)."""

    def __init__(self, option_strings, dest, use: str, extend: bool = False, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.use, self.extend = use, extend

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"serval bench serve: {option_string} is deprecated; use {self.use}", file=sys.stderr)
        if self.extend:
            values = [*(getattr(namespace, self.dest) or []), *values]
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint, dataset, load, sampling and report flags of ``serval bench serve``."""
    _add_endpoint_arguments(parser.add_argument_group("endpoint"))
    add_dataset_arguments(parser)
    lengths = parser.add_argument_group("lengths of any dataset (vLLM's general flags)")
    lengths.add_argument("--input-len", type=int, help="Sets --random-input-len.")
    lengths.add_argument("--output-len", type=int, help="Sets every dataset's output length flag.")
    _add_load_arguments(parser.add_argument_group("load"))
    sampling = parser.add_argument_group("sampling parameters (sent only when given; the server's defaults else)")
    for flag, kind in SAMPLING_FLAGS.items():
        sampling.add_argument(flag, type=kind, default=None)
    _add_report_arguments(parser.add_argument_group("report"))


def _add_endpoint_arguments(group) -> None:
    group.add_argument(
        "--backend",
        type=Backend,
        choices=list(Backend),
        default=Backend.OPENAI,
        metavar="{openai,openai-chat,openai-embeddings}",
    )
    group.add_argument("--base-url", help="Server base URL (default: http://{--host}:{--port}).")
    group.add_argument("--url", dest="base_url", action=DeprecatedAlias, use="--base-url", help=argparse.SUPPRESS)
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--endpoint", help="API path (default: the backend's: /v1/completions, /v1/chat/completions, /v1/embeddings)."
    )
    group.add_argument("--header", metavar="KEY=VALUE", nargs="*", help="Extra headers sent with every request.")
    group.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, as vLLM reads it).",
    )
    group.add_argument("--model", help="The model id requests name (default: the first in GET /v1/models).")
    group.add_argument("--served-model-name", help="The model name sent in requests, when not --model.")
    group.add_argument(
        "--tokenizer",
        help="Local Hugging Face tokenizer dir (default: --model if a dir, else its root in /v1/models).",
    )
    group.add_argument("--label", help="Prefix of the default result filename (default: --backend).")


def _add_load_arguments(load) -> None:
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Requests per second (default inf: all at once)."
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrival intervals: 1 is Poisson, < 1 burstier, > 1 steadier.",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="At most this many requests in flight.")
    load.add_argument("--num-warmups", type=int, default=0, help="Requests sent (and not counted) before the run.")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Send ignore_eos: generate exactly each request's output length. Default, as in vLLM: on for "
        "--dataset-name random, off otherwise.",
    )
    load.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="Seconds to wait on a connection or between streamed chunks before a request fails.",
    )


def _add_report_arguments(report) -> None:
    report.add_argument(
        "--percentile-metrics",
        type=parse_metric_names,
        default=None,
        help=f"Comma-separated metrics to report statistics of (default {','.join(METRICS)}, e2el for "
        "openai-embeddings; vLLM's: ttft,tpot,itl, e2el).",
    )
    report.add_argument(
        "--metric-percentiles",
        type=parse_percentiles,
        default=[99.0],
        help="Comma-separated percentiles of those metrics (default 99; the median is always reported).",
    )
    report.add_argument(
        "--percentiles",
        dest="metric_percentiles",
        type=parse_percentiles,
        action=DeprecatedAlias,
        use="--metric-percentiles",
        help=argparse.SUPPRESS,
    )
    report.add_argument(
        "--goodput",
        nargs="+",
        type=parse_goodput,
        action="extend",
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (NAME in ttft, tpot, e2el; milliseconds).",
    )
    report.add_argument(
        "--slo",
        dest="goodput",
        type=parse_slos,
        action=DeprecatedAlias,
        use="--goodput NAME:MS ...",
        extend=True,
        help=argparse.SUPPRESS,
    )
    _add_output_arguments(report)


def _add_output_arguments(report) -> None:
    report.add_argument(
        "--save-result",
        action="store_true",
        help="Write the JSON result and its plots (also done when --result-dir or --result-filename is given).",
    )
    report.add_argument(
        "--save-detailed", action="store_true", help="Include the per-request lists (ttfts, itls, ...) in the JSON."
    )
    report.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", help="Extra key-value pairs for the JSON.")
    report.add_argument("--result-dir", help="Directory of the JSON (default: the current directory).")
    report.add_argument(
        "--result-filename",
        help="Default: {label}-{request_rate}qps[-concurrency{N}]-{model basename}-{date}.json, as vLLM's.",
    )
    report.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def parse_key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """``["k=v", ...]`` (``--header``, ``--metadata``) as a dict; ``ValueError`` naming ``flag`` for an item
    without ``=``."""
    pairs = {}
    for item in items or []:
        key, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"{flag} takes KEY=VALUE pairs, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def base_url(args: argparse.Namespace) -> str:
    """``--base-url``, else ``http://{--host}:{--port}``; no trailing slash."""
    if args.base_url:
        return args.base_url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def api_url(args: argparse.Namespace) -> str:
    """The URL requests go to; ``ValueError`` when ``--endpoint`` is not the backend's API."""
    endpoint = args.endpoint or args.backend.default_endpoint
    if not endpoint.rstrip("/").endswith(args.backend.endpoint_suffix):
        raise ValueError(
            f"--backend {args.backend.value} calls an endpoint ending in "
            f"{args.backend.endpoint_suffix!r}, got --endpoint {endpoint!r}"
        )
    return base_url(args) + "/" + endpoint.lstrip("/")


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    """``--header`` pairs, then the bearer token of ``--api-key``."""
    headers = parse_key_values(args.header, "--header")
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def sampling_fields(args: argparse.Namespace) -> dict[str, float]:
    """The sampling fields given on the command line, by their request-body names."""
    names = [flag[2:].replace("-", "_") for flag in SAMPLING_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def is_ignore_eos(args: argparse.Namespace) -> bool:
    """``--ignore-eos`` / ``--no-ignore-eos``; unset, on for the random dataset only (vLLM forces it there)."""
    return args.ignore_eos if args.ignore_eos is not None else args.dataset_name == "random"


def apply_general_lengths(args: argparse.Namespace) -> None:
    """``--input-len`` and ``--output-len`` onto the datasets' own flags, as vLLM maps them."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.sharegpt_output_len = args.output_len

"""``serval render-rayservice``: the KubeRay RayService that serves a Serve config, rendered by Serval's chart.

    serval render-rayservice configs/serve/default.yaml [-f values.yaml ...] [--set key=value ...]

The Serve config goes to the chart (``helm/serval``) as ``serveConfigFile``, what ``helm install
--set-file serveConfigFile=<config>`` passes, so the printed manifest is what ``helm template`` / ``helm
install`` would produce for the same inputs. Rendering is real Helm (the Helm v4 library bundled by the
``helm-python-sdk`` package), offline: the chart's ``values.schema.json`` and its checks apply.

The Serve config is checked first as its app builders will check it in the cluster (``serval.config_check``):
a problem is refused in one line, exit code 2, nothing rendered.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serval.shipped import CHART_DIR

SUMMARY = "print the KubeRay RayService (Serval's Helm chart) that serves a Serve config on Kubernetes"

RAYSERVICE_TEMPLATE = "templates/rayservice.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a Serve config file (configs/serve/*.yaml)")
    parser.add_argument(
        "-f",
        "--values",
        action="append",
        default=[],
        metavar="YAML",
        help="a chart values file (repeatable; later files win, as with helm -f)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a chart value, helm --set syntax (repeatable; applied after the files)",
    )
    parser.add_argument("--name", default="serval", help="the release name (default: serval)")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--chart", default=str(CHART_DIR), help="the chart directory (default: helm/serval)")
    parser.add_argument(
        "--all",
        action="store_true",
        help="print every manifest the chart renders (PodMonitor, dashboard ConfigMap), not only the RayService",
    )


def run(args: argparse.Namespace) -> int:
    import helm_python  # the kubernetes extra (serval.extras: the command line checks it is installed)

    from deployments.config_errors import ConfigError
    from deployments.serve_config import check_serve_config
    from serval.config_check import load_serve_config, refuse

    try:
        with open(args.config, encoding="utf-8") as f:
            config_text = f.read()
        check_serve_config(load_serve_config(config_text, args.config))
        values = chart_values(config_text, args.values, args.set)
        manifests = render_chart(args.chart, values, args.name, args.namespace)
    except ConfigError as error:
        return refuse(error, "serval render-rayservice", args.config, getattr(args, "debug", False))
    except (OSError, helm_python.HelmError) as error:
        print(f"serval render-rayservice: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(format_manifests(manifests, only=None if args.all else RAYSERVICE_TEMPLATE))
    return 0


def chart_values(config_text: str, values_files: list[str], set_expressions: list[str]) -> dict:
    """The chart values ``helm -f FILE... --set EXPR... --set-file serveConfigFile=<config>`` would pass."""
    import helm_python

    values: dict = {}
    for path in values_files:
        with open(path, encoding="utf-8") as f:
            values = merge_values(values, helm_python.values_from_yaml(f.read()))
    for expression in set_expressions:
        values = merge_values(values, helm_python.parse_set_string(expression))
    return merge_values(values, {"serveConfigFile": config_text})


def merge_values(base: dict, override: dict) -> dict:
    """Helm's merge of user values: maps merge key by key, anything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = value
    return merged


def render_chart(chart_dir: str | Path, values: dict, name: str, namespace: str) -> dict[str, str]:
    """Template path (``serval/templates/...``) -> rendered text; raises ``HelmError`` on bad values."""
    from helm_python import Chart

    with Chart.load(chart_dir) as chart:
        return chart.render(values=values, name=name, namespace=namespace)


def format_manifests(manifests: dict[str, str], only: str | None = None) -> str:
    """``helm template``'s layout: one ``---`` document per non-empty manifest, headed by its source.

    ``only``: keep the template whose path ends with it. NOTES.txt is never a manifest.
    """
    documents = []
    for path in sorted(manifests):
        text = manifests[path].strip()
        if not text or path.endswith("NOTES.txt") or (only is not None and not path.endswith(only)):
            continue
        documents.append(f"---\n# Source: {path}\n{text}\n")
    return "".join(documents)

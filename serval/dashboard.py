"""``serval dashboard push``: Serval's Grafana dashboard, provisioned through the Grafana HTTP API.

The dashboard (``serval/dashboards/serval.json``, uid ``serval-overview``) charts what Prometheus
scrapes from Ray's metrics endpoint: the LLM servers' ``ray_serval_*`` series (see
``deployments/metrics.py``) and Ray Serve's own ``ray_serve_*`` series. Every metric name lives in
that JSON file's ``expr`` fields and nowhere else. Pushing overwrites the dashboard with the same uid,
so running it again is harmless.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from urllib.parse import urljoin, urlsplit

SUMMARY = "push Serval's Grafana dashboard (engine, latency and Ray Serve panels) to a Grafana server"

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
# Grafana's global variables that may appear in a query without a template variable behind them.
BUILTIN_VARIABLES = frozenset(
    {
        "__interval",
        "__interval_ms",
        "__rate_interval",
        "__rate_interval_ms",
        "__range",
        "__range_s",
        "__range_ms",
        "__from",
        "__to",
        "__dashboard",
        "__org",
        "__user",
    }
)
# $name, ${name}, ${name:format} and the deprecated [[name]].
_VARIABLE_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grafana-url", required=True, help="Grafana's base URL, e.g. http://127.0.0.1:3000")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--token", default=os.environ.get("GRAFANA_TOKEN"), help="service-account token (default: $GRAFANA_TOKEN)"
    )
    auth.add_argument("--basic-auth", metavar="USER:PASSWORD", help="basic authentication instead of a token")
    parser.add_argument(
        "--folder",
        default="Serval",
        help="folder to put the dashboard in, created if missing ('' for the General folder)",
    )
    parser.add_argument("--datasource-uid", help="uid of the Prometheus data source the dashboard selects first")
    parser.add_argument("--dashboard", help="dashboard JSON to push instead of the packaged one")


def run(args: argparse.Namespace) -> int:
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    try:
        dashboard = load_dashboard(args.dashboard)
        validate_dashboard(dashboard)
        credential = _credential(args.token, args.basic_auth)
        base_url = _base_url(args.grafana_url)
    except (OSError, ValueError) as error:
        print(f"serval dashboard push: {error}", file=sys.stderr)
        return 1
    if args.datasource_uid:
        dashboard = pin_datasource(dashboard, args.datasource_uid)
    api = GrafanaApi.from_url(base_url, credential=credential)
    try:
        url_path = push_dashboard(api, dashboard, args.folder)
    except GrafanaException as error:
        print(f"serval dashboard push: Grafana at {args.grafana_url} answered: {_error_text(error)}", file=sys.stderr)
        return 1
    except OSError as error:  # niquests' connection errors are OSErrors
        print(f"serval dashboard push: cannot reach Grafana at {args.grafana_url}: {error}", file=sys.stderr)
        return 1
    print(f"Dashboard {dashboard['title']!r}: {urljoin(_public_url(base_url), url_path)}")
    return 0


def load_dashboard(path: str | None = None) -> dict:
    """The dashboard model at ``path``, or the packaged ``serval/dashboards/serval.json``.

    Raises OSError when the file cannot be read and ValueError when it is not JSON.
    """
    if path is None:
        from importlib.resources import files

        text = files("serval").joinpath("dashboards", "serval.json").read_text(encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return json.loads(text)


def validate_dashboard(dashboard: dict) -> None:
    """Raises ValueError listing every defect that would leave a panel broken or misplaced in Grafana.

    Checked: unique panel ids; every non-row panel has a gridPos inside the 24-column grid, the
    ``${datasource}`` data source and at least one target; every target has a refId, a non-empty expr
    and no other data source; every variable an expr uses is a template variable or a Grafana built-in.
    """
    problems = [*_panel_problems(dashboard), *_variable_problems(dashboard)]
    if problems:
        raise ValueError(f"dashboard {dashboard.get('uid')!r} is invalid:\n  " + "\n  ".join(problems))


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every target of every non-row panel, in dashboard order."""
    return [
        (panel.get("title", ""), target.get("expr", ""))
        for panel in _query_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def panel_queries_by_row(dashboard: dict) -> dict[str, list[tuple[str, str]]]:
    """``panel_queries`` grouped by the title of the row each panel sits under (``""`` before any row)."""
    by_row: dict[str, list[tuple[str, str]]] = {}
    row = ""
    for panel in _all_panels(dashboard):
        if panel.get("type") == "row":
            row = panel.get("title", "")
            by_row.setdefault(row, [])
            continue
        by_row.setdefault(row, []).extend(
            (panel.get("title", ""), target.get("expr", "")) for target in panel.get("targets", [])
        )
    return by_row


def pin_datasource(dashboard: dict, datasource_uid: str) -> dict:
    """A copy of ``dashboard`` whose ``datasource`` variable starts on the data source ``datasource_uid``."""
    pinned = copy.deepcopy(dashboard)
    for variable in pinned["templating"]["list"]:
        if variable["type"] == "datasource":
            variable["current"] = {"selected": True, "text": datasource_uid, "value": datasource_uid}
    return pinned


def push_dashboard(api, dashboard: dict, folder_title: str) -> str:
    """Creates or overwrites ``dashboard`` (matched by uid) in folder ``folder_title``; returns its URL path.

    ``api`` is a ``grafana_client.GrafanaApi``. The folder is created when no top-level folder has
    that title; an empty title means the General folder.
    """
    body = {"dashboard": {**dashboard, "id": None}, "overwrite": True, "message": "serval dashboard push"}
    if folder_title:
        body["folderUid"] = ensure_folder(api, folder_title)
    return api.dashboard.update_dashboard(body)["url"]


def ensure_folder(api, title: str) -> str:
    """The uid of the top-level folder titled ``title``, created if there is none."""
    for folder in api.folder.get_all_folders():
        if folder["title"] == title:
            return folder["uid"]
    return api.folder.create_folder(title)["uid"]


def _credential(token: str | None, basic_auth: str | None) -> str | tuple[str, str] | None:
    if basic_auth is None:
        return token
    user, separator, password = basic_auth.partition(":")
    if not separator:
        raise ValueError("--basic-auth takes USER:PASSWORD")
    return user, password


def _error_text(error) -> str:
    """grafana-client's message ("Unauthorized") plus Grafana's own reason when it gave one."""
    reason = error.response.get("message") if isinstance(error.response, dict) else None
    return f"{error.message} ({reason})" if reason and reason not in error.message else error.message


def _base_url(grafana_url: str) -> str:
    parts = urlsplit(grafana_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--grafana-url must be an http(s) URL such as http://127.0.0.1:3000, got {grafana_url!r}")
    # grafana-client appends "api" to the URL's path: a sub-path without its trailing slash would
    # become ".../grafanaapi".
    return grafana_url if grafana_url.endswith("/") else grafana_url + "/"


def _public_url(url: str) -> str:
    """``url`` without user:password, fit to print."""
    parts = urlsplit(url)
    netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


def _all_panels(dashboard: dict) -> list[dict]:
    # A collapsed row holds its panels inside itself instead of after it.
    panels = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _query_panels(dashboard: dict) -> list[dict]:
    return [panel for panel in _all_panels(dashboard) if panel.get("type") != "row"]


def _panel_problems(dashboard: dict) -> list[str]:
    problems = []
    seen_ids = set()
    for panel in _all_panels(dashboard):
        name = f"panel {panel.get('id')} {panel.get('title', '')!r}"
        if panel.get("id") in seen_ids:
            problems.append(f"{name}: duplicate panel id {panel.get('id')}")
        seen_ids.add(panel.get("id"))
        if panel.get("type") != "row":
            problems.extend(f"{name}: {problem}" for problem in _query_panel_problems(panel))
    return problems


def _query_panel_problems(panel: dict) -> list[str]:
    problems = _grid_pos_problems(panel.get("gridPos"))
    if panel.get("datasource") != DATASOURCE_REF:
        problems.append(f"data source {panel.get('datasource')} is not {DATASOURCE_REF}")
    targets = panel.get("targets") or []
    if not targets:
        problems.append("no targets")
    for target in targets:
        if not target.get("refId"):
            problems.append(f"a target has no refId: {target}")
        if not str(target.get("expr", "")).strip():
            problems.append(f"target {target.get('refId')} has an empty expr")
        if target.get("datasource", DATASOURCE_REF) != DATASOURCE_REF:
            problems.append(f"target {target.get('refId')} has data source {target['datasource']}")
    return problems


def _grid_pos_problems(grid_pos: dict | None) -> list[str]:
    if not isinstance(grid_pos, dict) or not all(isinstance(grid_pos.get(key), int) for key in "xywh"):
        return [f"gridPos {grid_pos} lacks integer x, y, w, h"]
    if grid_pos["x"] < 0 or grid_pos["w"] < 1 or grid_pos["x"] + grid_pos["w"] > GRID_WIDTH:
        return [f"gridPos x={grid_pos['x']} w={grid_pos['w']} overflows the {GRID_WIDTH}-column grid"]
    return []


def _variable_problems(dashboard: dict) -> list[str]:
    variables = dashboard.get("templating", {}).get("list", [])
    defined = {variable.get("name") for variable in variables} | BUILTIN_VARIABLES
    problems = [
        f"variable {variable.get('name')!r}: data source {variable['datasource']} is not {DATASOURCE_REF}"
        for variable in variables
        if variable.get("datasource", DATASOURCE_REF) != DATASOURCE_REF
    ]
    for title, expr in panel_queries(dashboard):
        for match in _VARIABLE_RE.finditer(expr):
            name = next(group for group in match.groups() if group)
            if name not in defined:
                problems.append(f"panel {title!r}: expr uses undefined variable ${name}: {expr}")
    return problems

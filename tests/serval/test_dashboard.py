"""The packaged Grafana dashboard and ``serval dashboard push``.

The push tests run the CLI against a small stand-in for Grafana's HTTP API (the three endpoints
grafana-client calls: list folders, create a folder, save a dashboard), bound to 127.0.0.1.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serval import cli
from serval.dashboard import load_dashboard, panel_queries, validate_dashboard
from tests.conftest import REPO_ROOT

METRICS_MODULE = REPO_ROOT / "deployments" / "metrics.py"
# How Prometheus sees a ray.util.metrics metric: Ray's prefix, and the series one query reads.
PROMETHEUS_SUFFIX = {"Gauge": "", "Counter": "_total", "Histogram": "_bucket", "_histogram": "_bucket"}


def serval_metric_series() -> list[str]:
    """Each ``serval_*`` metric created in deployments/metrics.py, as the Prometheus series a panel reads."""
    series = []
    for node in ast.walk(ast.parse(METRICS_MODULE.read_text())):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        kind = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        name = node.args[0].value
        if kind in PROMETHEUS_SUFFIX and isinstance(name, str) and name.startswith("serval_"):
            series.append(f"ray_{name}{PROMETHEUS_SUFFIX[kind]}")
    return series


def test_packaged_dashboard_is_valid():
    dashboard = load_dashboard()
    validate_dashboard(dashboard)
    assert dashboard["uid"] == "serval-overview"
    assert [row["title"] for row in dashboard["panels"] if row["type"] == "row"] == [
        "Serval engine",
        "Latency",
        "Ray Serve",
        "Disaggregated prefill",
        "KV-aware routing",
        "Speculative decoding",
        "Autoscaling (TTFTPolicy)",
    ]


def test_every_serval_metric_has_a_panel():
    series = serval_metric_series()
    assert len(series) == 42, series
    exprs = "\n".join(expr for _, expr in panel_queries(load_dashboard()))
    missing = [name for name in series if not re.search(rf"\b{name}\b", exprs)]
    assert not missing, f"no panel reads {missing}"


def test_serval_queries_filter_by_model_and_use_the_rate_interval():
    for title, expr in panel_queries(load_dashboard()):
        if "ray_serval_autoscaling_" in expr:  # the policy's gauges, set in Serve's controller, carry the deployment
            assert 'deployment=~"LLMServer:$model_name"' in expr, title
        elif "ray_serval_" in expr:  # the prefill pool's engines report as "<model>:prefill"
            assert re.search(r'model_name=~"\$model_name(\(:prefill\)\?)?"', expr), title
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window == "$__rate_interval", f"{title}: {expr}"


def _first_query_panel(dashboard: dict) -> dict:
    return next(panel for panel in dashboard["panels"] if panel["type"] != "row")


def _break_duplicate_id(dashboard):
    dashboard["panels"][2]["id"] = dashboard["panels"][1]["id"]


def _break_missing_expr(dashboard):
    del _first_query_panel(dashboard)["targets"][0]["expr"]


def _break_undefined_variable(dashboard):
    _first_query_panel(dashboard)["targets"][0]["expr"] = 'sum(ray_serval_num_requests_running{replica=~"$replica"})'


def _break_grid_overflow(dashboard):
    _first_query_panel(dashboard)["gridPos"].update(x=20, w=8)


def _break_no_targets(dashboard):
    _first_query_panel(dashboard)["targets"] = []


def _break_datasource(dashboard):
    _first_query_panel(dashboard)["datasource"] = {"type": "prometheus", "uid": "my-prometheus"}


@pytest.mark.parametrize(
    "break_dashboard, message",
    [
        (_break_duplicate_id, "duplicate panel id"),
        (_break_missing_expr, "empty expr"),
        (_break_undefined_variable, r"undefined variable \$replica"),
        (_break_grid_overflow, "overflows the 24-column grid"),
        (_break_no_targets, "no targets"),
        (_break_datasource, "data source"),
    ],
)
def test_validation_catches_defect(break_dashboard, message):
    dashboard = copy.deepcopy(load_dashboard())
    break_dashboard(dashboard)
    with pytest.raises(ValueError, match=message):
        validate_dashboard(dashboard)


class FakeGrafana(ThreadingHTTPServer):
    """Grafana's folder and dashboard endpoints, in memory; every request is recorded."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _GrafanaHandler)
        self.requests: list[dict] = []
        self.folders: list[dict] = []
        self.dashboards: dict[str, dict] = {}
        self.fail_status: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _GrafanaHandler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def do_GET(self):
        self._handle()

    def do_POST(self):
        self._handle()

    def log_message(self, *args):
        pass

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append(
            {
                "method": self.command,
                "path": self.path.split("?")[0],
                "body": body,
                "authorization": self.headers.get("Authorization"),
            }
        )
        if self.server.fail_status:
            return self._reply(self.server.fail_status, {"message": "invalid API key"})
        route = (self.command, self.path.split("?")[0])
        if route == ("GET", "/api/folders"):
            return self._reply(200, self.server.folders)
        if route == ("POST", "/api/folders"):
            folder = {
                "id": len(self.server.folders) + 1,
                "uid": f"folder-{len(self.server.folders) + 1}",
                "title": body["title"],
            }
            self.server.folders.append(folder)
            return self._reply(200, folder)
        if route == ("POST", "/api/dashboards/db"):
            return self._save_dashboard(body)
        return self._reply(404, {"message": "Not found"})

    def _save_dashboard(self, body):
        dashboard = body["dashboard"]
        if dashboard["uid"] in self.server.dashboards and not body.get("overwrite"):
            return self._reply(412, {"message": "A dashboard with the same uid already exists"})
        self.server.dashboards[dashboard["uid"]] = body
        return self._reply(
            200,
            {
                "id": 1,
                "uid": dashboard["uid"],
                "status": "success",
                "version": 1,
                "url": f"/d/{dashboard['uid']}/serval",
                "slug": "serval",
            },
        )

    def _reply(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def grafana():
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def serval_main(monkeypatch):
    """``serval.cli.main`` with only the dashboard commands, so other subcommands' imports don't matter here."""
    monkeypatch.setattr(
        cli, "SUBCOMMANDS", {path: module for path, module in cli.SUBCOMMANDS.items() if path[0] == "dashboard"}
    )
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    return cli.main


def _posts(grafana: FakeGrafana, path: str) -> list[dict]:
    return [request for request in grafana.requests if request["method"] == "POST" and request["path"] == path]


def test_push_creates_folder_once_and_overwrites(grafana, serval_main, capsys):
    argv = ["dashboard", "push", "--grafana-url", grafana.url, "--token", "secret-token", "--folder", "LLM"]
    assert serval_main(argv) == 0
    assert serval_main(argv) == 0

    assert [folder["title"] for folder in grafana.folders] == ["LLM"]
    assert len(_posts(grafana, "/api/folders")) == 1
    saves = _posts(grafana, "/api/dashboards/db")
    assert len(saves) == 2
    for save in saves:
        assert save["body"]["overwrite"] is True
        assert save["body"]["folderUid"] == grafana.folders[0]["uid"]
        assert save["body"]["dashboard"]["uid"] == "serval-overview"
        assert save["body"]["dashboard"]["id"] is None
    assert all(request["authorization"] == "Bearer secret-token" for request in grafana.requests)
    assert capsys.readouterr().out.count(f"{grafana.url}/d/serval-overview/serval") == 2


def test_push_token_from_env_and_pinned_datasource(grafana, serval_main, monkeypatch):
    monkeypatch.setenv("GRAFANA_TOKEN", "env-token")
    # The parser reads the default when it is built, so build it after setting the variable.
    assert serval_main(["dashboard", "push", "--grafana-url", grafana.url, "--datasource-uid", "prom-1"]) == 0

    assert grafana.requests[0]["authorization"] == "Bearer env-token"
    variables = grafana.dashboards["serval-overview"]["dashboard"]["templating"]["list"]
    datasource = next(variable for variable in variables if variable["name"] == "datasource")
    assert datasource["current"]["value"] == "prom-1"


def test_push_basic_auth_to_general_folder(grafana, serval_main):
    assert (
        serval_main(["dashboard", "push", "--grafana-url", grafana.url, "--basic-auth", "admin:pw", "--folder", ""])
        == 0
    )
    assert grafana.requests[0]["authorization"].startswith("Basic ")
    assert not grafana.folders
    assert "folderUid" not in grafana.dashboards["serval-overview"]


def test_push_reports_grafana_error_without_traceback(grafana, serval_main, capsys):
    grafana.fail_status = 401
    assert serval_main(["dashboard", "push", "--grafana-url", grafana.url, "--token", "wrong"]) == 1
    err = capsys.readouterr().err
    assert "Unauthorized" in err and "invalid API key" in err
    assert "Traceback" not in err


def test_push_reports_unreachable_grafana(grafana, serval_main, capsys):
    url = grafana.url
    grafana.shutdown()
    grafana.server_close()
    assert serval_main(["dashboard", "push", "--grafana-url", url, "--token", "t"]) == 1
    assert "cannot reach Grafana" in capsys.readouterr().err


def test_push_rejects_invalid_dashboard_file(grafana, serval_main, tmp_path, capsys):
    dashboard = load_dashboard()
    _break_grid_overflow(dashboard)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(dashboard))
    assert serval_main(["dashboard", "push", "--grafana-url", grafana.url, "--dashboard", str(path)]) == 1
    assert "overflows" in capsys.readouterr().err
    assert not grafana.requests


def test_push_rejects_url_without_scheme(serval_main, capsys):
    assert serval_main(["dashboard", "push", "--grafana-url", "localhost:3000"]) == 1
    assert "http(s) URL" in capsys.readouterr().err

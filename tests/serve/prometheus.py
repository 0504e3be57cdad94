"""A real Prometheus server (Debian's ``prometheus`` package, which ``make test`` installs) for the tests.

``PrometheusServer`` runs the shipped ``configs/prometheus/prometheus.yml``
with the test's own scrape interval, app port and Ray service-discovery file,
listening on 127.0.0.1 only, its storage in a temporary directory.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from serval.launcher.head import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = ROOT / "configs" / "prometheus" / "prometheus.yml"
LOOPBACK = "127.0.0.1"
APP_SCRAPE_INTERVAL = "5s"


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path, "the prometheus binary is missing: `make test` installs Debian's prometheus package"
    return path


def test_config(app_port: int, scrape_interval: str) -> dict:
    """The shipped config, pointed at this test's app and scraped every ``scrape_interval``."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = scrape_interval
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["serval"]["static_configs"] = [{"targets": [f"{LOOPBACK}:{app_port}"]}]
    # A scrape times out after its interval: the app's /metrics reads every node's agent through the
    # ingress, which on a busy 2-core machine can take longer than one second.
    jobs["serval"]["scrape_interval"] = jobs["serval"]["scrape_timeout"] = APP_SCRAPE_INTERVAL
    return config


class PrometheusServer:
    """Prometheus on 127.0.0.1 (a free port) scraping Ray's nodes and the app; a context manager."""

    def __init__(self, work_dir: Path, app_port: int, scrape_interval: str = "1s") -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        config_path = work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(test_config(app_port, scrape_interval)))
        self.command = [
            prometheus_binary(),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address={LOOPBACK}:{self.port}",
        ]
        self.log_path = work_dir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._is_ready():
            assert self.process.poll() is None, f"prometheus exited: {self.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        return self

    def __exit__(self, *exc_info) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def _is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def targets(self) -> list[dict]:
        return self._api("targets")["activeTargets"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now (raises on a query error)."""
        result = self._api("query", {"query": expr})
        assert result["resultType"] == "vector", result
        return result["result"]

    def _api(self, path: str, params: dict | None = None):
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]

"""The app's ``GET /metrics``: every replica's ``serval_*`` metrics, gathered from Ray's metrics agents.

The LLM-server replicas record through ``ray.util.metrics`` (see
``deployments.metrics``); each node's metrics agent aggregates its replicas
and serves them, with Ray's ``ray_`` prefix, on the node's Prometheus
endpoint. A scrape of the app reads every live node's endpoint, keeps the
``ray_serval_*`` families, merges them across nodes and serves them under
their own names (``serval_time_to_first_token_seconds`` ...), so one scrape
target covers the whole deployment whichever replica answers it.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

RAY_PREFIX = "ray_"
SERVAL_PREFIX = "serval_"
SCRAPE_TIMEOUT_S = 5.0


def node_metrics_urls() -> list[str]:
    """The Prometheus endpoint of every live node's metrics agent (a GCS call: blocking)."""
    import ray

    return [
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in ray.nodes()
        if node.get("Alive") and node.get("MetricsExportPort")
    ]


def serval_families(texts: list[str]) -> list[Metric]:
    """The ``ray_serval_*`` families of several Prometheus text pages, merged by name, ``ray_`` dropped.

    Samples of different nodes differ in Ray's own labels (``NodeAddress`` ...),
    so merging never produces two samples with the same name and labels.
    """
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(serval_lines(text)):
            if not family.name.startswith(RAY_PREFIX + SERVAL_PREFIX):
                continue
            name = family.name.removeprefix(RAY_PREFIX)
            target = merged.setdefault(name, Metric(name, family.documentation, family.type, family.unit))
            target.samples.extend(
                sample._replace(name=sample.name.removeprefix(RAY_PREFIX)) for sample in family.samples
            )
    return list(merged.values())


def serval_lines(text: str) -> str:
    """The lines of a Prometheus text page that belong to ``ray_serval_*`` families (samples, HELP, TYPE).

    A node's page holds all of Ray's and Serve's metrics too, many times more lines than ours:
    parsing only these keeps a scrape of the app fast however much else the node exports.
    """
    prefix = RAY_PREFIX + SERVAL_PREFIX
    return "".join(
        line
        for line in text.splitlines(keepends=True)
        if line.startswith(prefix) or line.startswith(("# HELP " + prefix, "# TYPE " + prefix))
    )


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(families: list[Metric]) -> bytes:
    """The Prometheus text exposition of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


async def scrape_serval_metrics() -> bytes:
    """Reads every node's endpoint concurrently; a node that does not answer is left out of this scrape."""
    urls = await asyncio.to_thread(node_metrics_urls)
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        responses = await asyncio.gather(*(client.get(url) for url in urls), return_exceptions=True)
    texts = [r.text for r in responses if isinstance(r, httpx.Response) and r.status_code == 200]
    return render(serval_families(texts))

"""One soak request: what it asks for (:class:`RequestSpec`) and what became of it (:class:`Outcome`).

Every request asks for an exact number of tokens (``max_tokens`` with ``ignore_eos``), so its fate can be
judged from the response alone:

- ``ok``: complete: the token count in ``usage`` equals ``max_tokens``, and a stream ended with ``[DONE]``;
- ``disconnected``: the client closed the stream on purpose after ``disconnect_after`` chunks;
- ``error``: an HTTP error status, a refused connection or an SSE error event (an honest failure);
- ``cut``: the response ended without ``[DONE]`` or an error, or with a wrong token count;
- ``hung``: no byte arrived for the stall limit.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

FATES = ("ok", "disconnected", "error", "cut", "hung")
MIGRATIONS_METRIC = "serval_migrations"  # the ingress's count (deployments/metrics.py MigrationMetrics)
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains and the sea "
    "under a bright morning sky full of clouds"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request: endpoint (``completions`` or ``chat``), streamed or not, prompt, exact output length,
    and for a stream the number of content chunks after which the client hangs up (None: never)."""

    index: int
    endpoint: str
    stream: bool
    prompt: str
    max_tokens: int
    disconnect_after: int | None = None


@dataclass
class Outcome:
    """A request's fate and its times in seconds since the soak started (``start``, ``end``)."""

    index: int
    endpoint: str
    stream: bool
    max_tokens: int
    start: float
    end: float = 0.0
    fate: str = ""
    detail: str = ""
    num_tokens: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


def random_spec(index: int, rng: random.Random, settings) -> RequestSpec:
    """A request drawn from ``settings`` (``prompt_words``, ``max_tokens`` as (low, high) ranges,
    ``stream_fraction``, ``chat_fraction``, ``disconnect_fraction``)."""
    endpoint = "chat" if rng.random() < settings.chat_fraction else "completions"
    stream = rng.random() < settings.stream_fraction
    max_tokens = rng.randint(*settings.max_tokens)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*settings.prompt_words)))
    disconnect_after = None
    if stream and max_tokens > 1 and rng.random() < settings.disconnect_fraction:
        disconnect_after = rng.randint(1, max(1, max_tokens // 2))
    return RequestSpec(index, endpoint, stream, prompt, max_tokens, disconnect_after)


def request_body(spec: RequestSpec, model: str) -> tuple[str, dict]:
    """The path and JSON body of ``spec``."""
    body = {"model": model, "max_tokens": spec.max_tokens, "ignore_eos": True, "temperature": 0.0}
    if spec.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if spec.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": spec.prompt}]}
    return "/v1/completions", {**body, "prompt": spec.prompt}


async def send(client, base_url: str, model: str, spec: RequestSpec, soak_start: float, headers=None) -> Outcome:
    """Sends ``spec`` on ``client`` (an ``httpx.AsyncClient`` whose read timeout is the stall limit) and
    returns its :class:`Outcome`; never raises for what the server or the network did."""
    import httpx

    outcome = Outcome(spec.index, spec.endpoint, spec.stream, spec.max_tokens, time.perf_counter() - soak_start)
    path, body = request_body(spec, model)
    try:
        if spec.stream:
            async with client.stream("POST", base_url + path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    _judge_status(outcome, response.status_code, await response.aread())
                else:
                    await _read_stream(response, spec, outcome)
        else:
            response = await client.post(base_url + path, json=body, headers=headers)
            if response.status_code != 200:
                _judge_status(outcome, response.status_code, response.content)
            else:
                _judge_usage(outcome, spec, response.json().get("usage"), done=True)
    except (httpx.ReadTimeout, httpx.ConnectTimeout, httpx.WriteTimeout) as exc:
        outcome.fate, outcome.detail = "hung", f"{type(exc).__name__}: no byte within the stall limit"
    except httpx.ConnectError as exc:  # nothing was sent: the server refused, an honest failure
        outcome.fate, outcome.detail = "error", f"ConnectError: {exc}"
    except (httpx.HTTPError, ValueError) as exc:  # the connection closed mid-response, or half a JSON body
        outcome.fate, outcome.detail = "cut", f"{type(exc).__name__}: {exc}"
    outcome.end = time.perf_counter() - soak_start
    return outcome


def _judge_status(outcome: Outcome, status: int, body: bytes) -> None:
    outcome.fate, outcome.detail = "error", f"HTTP {status}: {body[:300].decode(errors='replace')}"


def _judge_usage(outcome: Outcome, spec: RequestSpec, usage: dict | None, done: bool) -> None:
    """ok when complete with exactly ``max_tokens`` tokens, else cut (saying why)."""
    outcome.num_tokens = (usage or {}).get("completion_tokens")
    if not done:
        outcome.fate, outcome.detail = "cut", "the stream ended without [DONE]"
    elif outcome.num_tokens != spec.max_tokens:
        outcome.fate, outcome.detail = "cut", f"completion_tokens {outcome.num_tokens} != max_tokens {spec.max_tokens}"
    else:
        outcome.fate = "ok"


async def _read_stream(response, spec: RequestSpec, outcome: Outcome) -> None:
    """Reads SSE events until ``[DONE]``, an error event, the end of the body, or the planned hang-up."""
    usage, chunks = None, 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            _judge_usage(outcome, spec, usage, done=True)
            return
        event = json.loads(data)
        if "error" in event:
            outcome.fate, outcome.detail = "error", f"error event: {json.dumps(event['error'])[:300]}"
            return
        if event.get("choices"):
            chunks += 1
        usage = event.get("usage") or usage
        if spec.disconnect_after is not None and chunks >= spec.disconnect_after:
            outcome.fate, outcome.detail = "disconnected", f"after {chunks} chunks"
            return  # leaving the ``client.stream`` block closes the connection mid-stream
    _judge_usage(outcome, spec, usage, done=False)


def read_migrations(base_url: str, headers=None) -> dict[str, float] | None:
    """The app's ``serval_migrations`` counts by kind (``continued``, ``resent``) from its ``/metrics``; None
    when it cannot be read. A migrated request that completes is ``ok``: only this count tells it apart."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None
    return migration_counts(text)


def migration_counts(text: str, metric: str = MIGRATIONS_METRIC) -> dict[str, float]:
    """``metric``'s counts by kind, summed over its other labels, in a Prometheus text page (``metric``:
    ``ray_serval_migrations`` on a node's own metrics endpoint, where Ray's prefix is still on)."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(metric) and 'kind="' in line:
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            counts[kind] = counts.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts

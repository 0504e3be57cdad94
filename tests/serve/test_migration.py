"""Request migration on a real cluster: two tiny-llama LLM-server replicas behind the OpenAiIngress. The replica
serving greedy streams (completions and chat, through the openai client) is SIGKILLed mid-stream: every stream
ends with [DONE] and no error, with the text, tokens and usage of an uninterrupted run, and the ingress counts
the migrations; with ``migration_limit: 0`` the same kill ends the stream with an error event, not a cut."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from ray import serve

from serval.bench.soak_client import read_migrations
from tests.serve.cluster import deploy_and_wait, llm_config, serve_config, sse_lines

# ~60-80 s on the shared 2-core machine: the Ray head and two replicas starting is most of it.
pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
SERVER = f"LLMServer:{LLAMA}"
MAX_TOKENS = 1800  # long enough for a stream to be in flight when the kill lands, on a fast CPU too
PROMPT = "The colours of the rainbow are"
MESSAGES = [{"role": "user", "content": "Count the colours of the rainbow."}]


def app_config(checkpoint: str, migration_limit: int | None = None) -> dict:
    config = llm_config(LLAMA, checkpoint, num_replicas=2, max_model_len=2048)
    config["deployment_config"]["health_check_period_s"] = 1.0
    app = serve_config(0, [config])["applications"][0]
    if migration_limit is not None:
        app["args"]["migration_limit"] = migration_limit
    return app


@pytest.fixture(scope="module")
def app(ray_head, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    config = serve_config(ray_head.http_port, [])
    config["applications"] = [app_config(checkpoint)]
    deploy_and_wait(ray_head, config)
    return ray_head, checkpoint


def client(head) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


class Stream(threading.Thread):
    """One greedy stream read to its end: its chunks (ids, text, logprob tokens, finish, usage) or its error."""

    def __init__(self, head, kind: str) -> None:
        super().__init__(daemon=True)
        self.head, self.kind = head, kind
        self.chunks: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        common = {"model": LLAMA, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        common |= {"stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
        try:
            if self.kind == "completion":
                stream = client(self.head).completions.create(prompt=PROMPT, logprobs=0, **common)
            else:
                stream = client(self.head).chat.completions.create(messages=MESSAGES, logprobs=True, **common)
            for chunk in stream:
                self.chunks.append(chunk)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def result(self) -> dict:
        assert self.error is None, f"{self.kind} stream failed: {self.error!r}"
        text, tokens, finish, usage = "", [], None, None
        for chunk in self.chunks:
            for choice in chunk.choices:
                if self.kind == "completion":
                    text += choice.text
                    tokens += choice.logprobs.tokens if choice.logprobs else []
                else:
                    text += choice.delta.content or ""
                    tokens += [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return {"text": text, "tokens": tokens, "finish": finish, "usage": usage.model_dump() if usage else None}

    @property
    def ids(self) -> set[str]:
        return {chunk.id for chunk in self.chunks}


def serving_replica_pid(timeout_s: float = 60.0) -> int:
    """The pid of the first replica seen with requests running, through its stats: its engine core's parent.

    Asked of the engines, not of the clients: a replica generates faster than a loaded test process reads
    its streams, so a client that has read a few chunks may be reading what an engine finished long ago.
    """
    handle = serve.get_deployment_handle(SERVER, app_name="llm")
    stats: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        result = handle.stats.remote().result()
        stats[result["replica_id"]] = result
        if result["num_running_reqs"] > 0:
            break
        assert time.monotonic() < deadline, f"no replica was seen running requests: {stats}"
    with open(f"/proc/{result['engine_core_pid']}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("PPid:")))


def wait_for_chunks(streams: list[Stream], count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(len(s.chunks) >= count or s.error or not s.is_alive() for s in streams):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.02)
    assert all(s.is_alive() for s in streams), "a stream ended before the kill: MAX_TOKENS is too small here"


def test_streams_survive_the_kill_of_their_replica(app):
    head, _ = app
    references = {}
    for kind in ("completion", "chat"):
        reference = Stream(head, kind)
        reference.run()
        references[kind] = reference.result()
        assert references[kind]["usage"]["completion_tokens"] == MAX_TOKENS
        assert len(references[kind]["tokens"]) == MAX_TOKENS
    streams = [Stream(head, kind) for kind in ("completion", "chat", "completion", "chat")]
    for stream in streams:
        stream.start()
    wait_for_chunks(streams, 1)  # each has its first token; the kill lands where an engine is generating
    os.kill(serving_replica_pid(), signal.SIGKILL)
    for stream in streams:
        stream.join(timeout=120)
        assert not stream.is_alive(), "a stream hung"
    for stream in streams:
        assert stream.result() == references[stream.kind]  # text, tokens, finish reason and exact usage
        assert len(stream.ids) == 1  # one id across replicas
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every few seconds
    while (read_migrations(head.base_url) or {}).get("continued", 0) < 1:  # what `serval bench soak` records
        assert time.monotonic() < deadline, "serval_migrations did not count the migrated streams"
        time.sleep(2)


def test_without_migration_the_kill_ends_the_stream_with_an_error_event(app):
    head, checkpoint = app
    config = serve_config(head.http_port, [])
    config["applications"] = [app_config(checkpoint, migration_limit=0)]
    deploy_and_wait(head, config)
    events: list[str] = []
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body["ignore_eos"] = True

    def read() -> None:
        with httpx.stream("POST", f"{head.base_url}/v1/completions", json=body, timeout=120) as response:
            events.extend(line for line in sse_lines(response) if line.startswith("data: "))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len(events) < 3:
        assert time.monotonic() < deadline and reader.is_alive(), "the stream did not start"
        time.sleep(0.02)
    os.kill(serving_replica_pid(), signal.SIGKILL)
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :])
    assert "migration_limit is 0" in error["error"]["message"], error
    assert error["error"]["code"] == 503

"""Request migration on a real cluster: two tiny-llama LLM-server replicas behind the OpenAiIngress. The replica
serving greedy streams (completions and chat, through the openai client) is SIGKILLed mid-stream: every stream
ends with [DONE] and no error, with the text, tokens and usage of an uninterrupted run, and the ingress counts
exactly the streams the killed replica held as migrations; with ``migration_limit: 0`` the same kill ends the
stream with an error event, not a cut. A Responses conversation goes on (``previous_response_id``) after the
replica that answered its first turn is killed: the app's response store is a named actor, no replica's.

No race decides what is proved: the replica killed is the one whose engine holds the most requests, asked of
each replica (not through Serve's router), and the engines are held still around the kill, stepped only
while a request they hold has not started (``kill_mid_stream``), so every request is in flight when it
lands, on a fast CPU or a loaded one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import openai
import psutil
import pytest
import ray

from deployments.response_store import ACTOR_NAME_PREFIX, ACTOR_NAMESPACE
from serval.bench.soak_client import MIGRATIONS_METRIC, migration_counts, read_migrations
from tests.conftest import wait_until
from tests.serve.cluster import (
    LOOPBACK,
    Replica,
    deploy_and_wait,
    llm_config,
    replica_loads,
    running_replicas,
    serve_config,
    sse_lines,
)

# ~60-80 s on the shared 2-core machine: the Ray head and two replicas starting is most of it.
pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
SERVER = f"LLMServer:{LLAMA}"
MAX_TOKENS = 600  # the engines make a few tokens of each before the kill (kill_mid_stream), far fewer
PROMPT = "The colours of the rainbow are"
MESSAGES = [{"role": "user", "content": "Count the colours of the rainbow."}]
RESPONSE_KWARGS = {"model": LLAMA, "max_output_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
FIRST_TURN = {**RESPONSE_KWARGS, "max_output_tokens": MAX_TOKENS // 2}


def app_config(checkpoint: str, migration_limit: int | None = None) -> dict:
    config = llm_config(LLAMA, checkpoint, num_replicas=2, max_model_len=1024)
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
        self.client = client(head)  # made here, not in run(): the streams then start together
        self.chunks: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        common = {"model": LLAMA, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        common |= {"stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
        try:
            if self.kind == "completion":
                stream = self.client.completions.create(prompt=PROMPT, logprobs=0, **common)
            else:
                stream = self.client.chat.completions.create(messages=MESSAGES, logprobs=True, **common)
            for chunk in stream:
                self.chunks.append(chunk)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def summary(self) -> str:
        """What the stream got so far: its error, or its chunks, finish reason and usage (a stream that ends with
        neither an error nor a finish reason was cut: the openai client ends it without a word)."""
        if self.error:
            return f"{self.kind}: {self.error!r}"
        finish = next((c.finish_reason for chunk in self.chunks for c in chunk.choices if c.finish_reason), None)
        usage = next((chunk.usage.completion_tokens for chunk in self.chunks if chunk.usage), None)
        return f"{self.kind}: {len(self.chunks)} chunks, finish {finish}, completion tokens {usage}"

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


class EnginePause:
    """Every replica's engine core (the processes below each replica) stopped (SIGSTOP), continued (SIGCONT)
    or let run for a moment (``step``): a stopped engine makes no token and finishes no request, while its
    replica serves on (the tokens already made still reach their clients)."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.processes = {
            replica.replica_id: psutil.Process(replica.pid).children(recursive=True) for replica in replicas
        }

    def stop(self) -> None:
        for processes in self.processes.values():
            for process in processes:
                process.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        for processes in self.processes.values():
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGCONT)

    def step(self, replica_ids: list[str], cpu_s: float = 0.004, timeout_s: float = 0.2) -> None:
        """Continues the engines of ``replica_ids`` one at a time, each until it has used ``cpu_s`` of CPU (a
        few steps of the tiny model) or for ``timeout_s`` (an idle engine uses none), then stops it: a measure
        of work, not of time, on a machine whose load decides how much CPU a moment holds. One at a time, so
        that each gets its share: continued together, the first one scheduled could use the share of all."""
        for process in (process for replica_id in replica_ids for process in self.processes[replica_id]):
            with contextlib.suppress(psutil.NoSuchProcess):
                start = self._cpu(process)
                process.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline and self._cpu(process) - start < cpu_s:
                    time.sleep(0.001)
                process.send_signal(signal.SIGSTOP)

    @staticmethod
    def _cpu(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system


def unstarted_requests(replicas: list[Replica]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Per replica, the requests it holds (Serve's count of its ongoing calls) that its engine has not yet
    started (running in its engine's latest snapshot: ``replica_loads``), and those loads."""
    ongoing = {replica.replica_id: replica.actor.get_num_ongoing_requests.remote() for replica in replicas}
    loads = replica_loads(replicas)
    for replica_id, call in ongoing.items():
        loads[replica_id]["num_ongoing"] = ray.get(call, timeout=30)
    return {replica_id: load["num_ongoing"] - load["num_running"] for replica_id, load in loads.items()}, loads


def kill_mid_stream(
    replicas: list[Replica], start: Callable[[], None], num_requests: int, reached: Callable[[], bool]
) -> int:
    """``start()``s ``num_requests`` requests and SIGKILLs the replica whose engine holds the most of them
    while every one is in flight and has reached its client (``reached()``, which raises once a request
    has ended: there is nothing left to kill it in); returns how many it held.

    By construction, whatever the speed and the load of the CPU: from before the start to the kill the
    engines are stopped, and one runs only in short steps of CPU work (``EnginePause.step``) while its
    replica holds a request that it has not started (once all run, while one has not reached its client): no
    engine makes a token while a request is still on its way through the ingress and Serve's router (which, on a
    loaded machine, can take seconds), so the requests that started early cannot finish while the last ones
    travel. The killed replica's engine core, continued, sees its parent gone and exits.
    """
    pause = EnginePause(replicas)
    pause.stop()
    try:
        start()
        deadline = time.monotonic() + 60
        while True:
            unstarted, loads = unstarted_requests(replicas)
            is_running = sum(load["num_running"] for load in loads.values()) == num_requests
            try:
                has_reached = reached()  # asked every time: it raises once a request has ended
            except AssertionError as error:
                raise AssertionError(f"{error}; the replicas' loads: {loads}") from None
            # Every request running has its first token made: stopped, the engines let it reach its client.
            if is_running and (has_reached or wait_until(reached, 1.0)):
                break
            assert time.monotonic() < deadline, f"the requests did not all run and reach their clients: {loads}"
            # All running but not yet reached (a client that waits for a few events: the step that started a
            # request may have made one token): the engines running them step on, else those with one to start.
            if is_running:
                pause.step([replica_id for replica_id, load in loads.items() if load["num_running"] > 0])
            else:
                pause.step([replica_id for replica_id, count in unstarted.items() if count > 0])
            time.sleep(0.02)
        held = {replica_id: load["num_running"] + load["num_waiting"] for replica_id, load in loads.items()}
        victim = max(replicas, key=lambda replica: held[replica.replica_id])
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        pause.cont()
    return held[victim.replica_id]


def node_migrations(head) -> dict[str, float]:
    """``serval_migrations`` by kind as the node's metrics agent serves it (Ray's ``ray_`` prefix on), read
    from the node's own endpoint: where the ingress replica's counter arrives, every export period."""
    text = httpx.get(f"http://{LOOPBACK}:{head.metrics_port}/metrics", timeout=60).text
    return migration_counts(text, f"ray_{MIGRATIONS_METRIC}")


def counted_since(before: dict[str, float], now: dict[str, float] | None) -> dict[str, float]:
    return {kind: count - before.get(kind, 0.0) for kind, count in (now or {}).items() if count != before.get(kind)}


def migrations_read(head) -> tuple[dict[str, float], dict[str, float]]:
    """``serval_migrations`` by kind on the node's metrics endpoint and in the app's ``/metrics`` (what
    ``serval bench soak`` records; the ingress gathers it from every node's endpoint)."""
    return node_migrations(head), read_migrations(head.base_url) or {}


def assert_counted(head, before: tuple[dict, dict], expected: dict[str, float]) -> None:
    """Waits until both reads (``migrations_read``) show ``expected`` more migrations than ``before``: the
    ingress's counter reaches the node's metrics agent at its next export (every
    ``metrics_report_interval_ms``), so six periods without it fail."""
    deadline = time.monotonic() + 6 * ray._config.metrics_report_interval_ms() / 1000
    while (counted := tuple(map(counted_since, before, migrations_read(head)))) != (expected, expected):
        assert time.monotonic() < deadline, f"serval_migrations counted {counted} (node, app), not {expected}"
        time.sleep(0.5)


def reference_results(head) -> dict[str, dict]:
    """Each kind's uninterrupted stream (the two at once): what a migrated stream must equal."""
    references = {kind: Stream(head, kind) for kind in ("completion", "chat")}
    for reference in references.values():
        reference.start()
    results = {}
    for kind, reference in references.items():
        reference.join(timeout=300)
        results[kind] = reference.result()
        assert results[kind]["usage"]["completion_tokens"] == MAX_TOKENS
        assert len(results[kind]["tokens"]) == MAX_TOKENS
    return results


def test_streams_survive_the_kill_of_their_replica(app):
    head, _ = app
    references = reference_results(head)
    replicas = running_replicas(head, SERVER)
    assert len(replicas) == 2
    before = migrations_read(head)
    streams = [Stream(head, kind) for kind in ("completion", "chat", "completion", "chat")]

    def reached() -> bool:  # each stream has reached its client: the ingress continues it, not resends it
        assert all(s.is_alive() for s in streams), f"a stream ended before the kill: {[s.summary() for s in streams]}"
        return all(s.chunks for s in streams)

    num_killed = kill_mid_stream(replicas, lambda: [s.start() for s in streams], len(streams), reached)
    assert all(stream.is_alive() for stream in streams)
    expected = {"continued": float(num_killed)}
    for stream in streams:
        stream.join(timeout=300)
        assert not stream.is_alive(), "a stream hung"
    for stream in streams:
        assert stream.result() == references[stream.kind]  # text, tokens, finish reason and exact usage
        assert len(stream.ids) == 1  # one id across replicas
    assert_counted(head, before, expected)


def first_turn_and_its_replica(head, replicas: list[Replica]) -> tuple[object, Replica]:
    """A stored response and the replica that served it: asked of each replica while it runs (the engines held
    still around the question, ``EnginePause``), as the router's choice is not for the test to know."""
    answers: list = []
    turn = threading.Thread(
        # Long enough that no step of the held engines (EnginePause.step) can finish it unseen.
        target=lambda: answers.append(client(head).responses.create(input="Hi!", **FIRST_TURN)),
        daemon=True,
    )
    pause = EnginePause(replicas)
    pause.stop()
    try:
        turn.start()
        deadline = time.monotonic() + 60
        while True:
            unstarted, loads = unstarted_requests(replicas)
            if any(load["num_running"] + load["num_waiting"] for load in loads.values()):
                break
            assert turn.is_alive() and time.monotonic() < deadline, f"the first turn never ran: {answers}, {loads}"
            pause.step([replica_id for replica_id, count in unstarted.items() if count > 0])
            time.sleep(0.02)
    finally:
        pause.cont()
    turn.join(timeout=120)
    [first] = answers
    [served_by] = [r for r in replicas if loads[r.replica_id]["num_running"] + loads[r.replica_id]["num_waiting"]]
    return first, served_by


def test_a_conversation_goes_on_after_the_replica_that_answered_it_died(app):
    """``previous_response_id`` is resolved from the app's response store, a named actor of its own: the replica
    that answered the first turn SIGKILLed, the second turn (streamed) is served by the other one as if the
    whole conversation had been sent again."""
    head, _ = app
    assert wait_until(lambda: len(running_replicas(head, SERVER)) == 2, 180), "the killed replica was not replaced"
    first, served_by = first_turn_and_its_replica(head, running_replicas(head, SERVER))
    os.kill(served_by.pid, signal.SIGKILL)  # Serve may route the next turn there still: the ingress resends it
    with client(head).responses.stream(input="And then?", previous_response_id=first.id, **RESPONSE_KWARGS) as stream:
        *_, last = stream  # streamed through the ingress, and stored from the stream
    assert last.type == "response.incomplete"  # max_output_tokens reached (the SDK's final response: completed only)
    second = last.response
    conversation = [{"role": "user", "content": "Hi!"}, *(item.model_dump(exclude_none=True) for item in first.output)]
    resent = client(head).responses.create(
        input=[*conversation, {"role": "user", "content": "And then?"}], store=False, **RESPONSE_KWARGS
    )
    assert (second.output_text, second.usage.input_tokens) == (resent.output_text, resent.usage.input_tokens)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client(head).responses.retrieve(first.id).output_text == first.output_text
    assert client(head).responses.retrieve(second.id).output_text == second.output_text
    store = ray.get_actor(f"{ACTOR_NAME_PREFIX}llm", namespace=ACTOR_NAMESPACE)
    assert ray.get(store.num_stored.remote()) >= 2  # the two stored turns (store: false was not kept)


def test_without_migration_the_kill_ends_the_stream_with_an_error_event(app):
    head, checkpoint = app
    config = serve_config(head.http_port, [])
    config["applications"] = [app_config(checkpoint, migration_limit=0)]
    deploy_and_wait(head, config)
    replicas = running_replicas(head, SERVER)
    events: list[str] = []
    body = {"model": LLAMA, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body["ignore_eos"] = True

    ended: list = []  # the response's status, or what the request raised

    def read() -> None:
        try:
            with httpx.stream("POST", f"{head.base_url}/v1/completions", json=body, timeout=120) as response:
                ended.append(response.status_code)
                events.extend(line for line in sse_lines(response) if line.startswith("data: "))
        except httpx.HTTPError as exc:
            ended.append(exc)

    def reached() -> bool:
        assert reader.is_alive() or len(events) >= 3, f"the stream ended before the kill: {ended}, {events[-3:]}"
        return len(events) >= 3

    reader = threading.Thread(target=read, daemon=True)
    assert kill_mid_stream(replicas, reader.start, 1, reached) == 1
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :])
    assert "migration_limit is 0" in error["error"]["message"], error
    assert error["error"]["code"] == 503

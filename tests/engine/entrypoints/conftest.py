"""Fixtures for the OpenAI server tests: a real AsyncLLM on the tiny Qwen2 checkpoint behind
``build_app(LocalModelRouter(...))``, served by uvicorn on 127.0.0.1 in a thread.

* ``engine``: the session's AsyncLLM (``ENGINE_KWARGS``), served as ``MODEL``.
* ``server`` / ``base_url`` / ``client``: the app, its URL, the official ``openai`` client.
* ``offline``: the offline ``LLM`` on the same checkpoint, the reference for greedy text.
* ``qwen3_base_url``: a second server, its engine with the ``qwen3`` reasoning parser.
* ``ServerThread``: serve any app (tests build their own for other engines / routers).
* ``wait_until_idle(engine)``: no request left and every KV block free again.
"""

from __future__ import annotations

import functools
import socket
import threading
import time

import openai
import pytest

from tests.conftest import engine_kwargs
from tests.conftest import make_async_llm as make_test_async_llm

MODEL = "tiny-qwen"
LOOPBACK = "127.0.0.1"
ENGINE_KWARGS = engine_kwargs(max_model_len=2048, max_num_seqs=8, num_gpu_blocks_override=512)


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a daemon thread; a context manager."""

    def __init__(self, app) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((LOOPBACK, 0))
        self.base_url = f"http://{LOOPBACK}:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True, name="uvicorn-test-server"
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self._socket.close()
        assert not self.thread.is_alive(), "the test server did not stop"


# Built as the servers build it (vLLM's throughput logger on); call sites override the arguments.
make_async_llm = functools.partial(make_test_async_llm, like_the_server=True, **ENGINE_KWARGS)


def serve_models(servings: dict) -> ServerThread:
    from engine.entrypoints.openai.api_server import LocalModelRouter, build_app

    return ServerThread(build_app(LocalModelRouter(servings)))


def make_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def engine(model_path):
    llm = make_async_llm(model_path)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def serving(engine):
    from engine.entrypoints.openai.serving import OpenAIServing

    return OpenAIServing(engine, MODEL)


@pytest.fixture(scope="session")
def base_url(serving):
    with serve_models({MODEL: serving}) as server:
        yield server.base_url


@pytest.fixture(scope="session")
def client(base_url) -> openai.OpenAI:
    return make_client(base_url)


@pytest.fixture(scope="session")
def offline(model_path):
    from engine import LLM

    return LLM(model=model_path, **ENGINE_KWARGS)


@pytest.fixture(scope="session")
def qwen3_base_url(model_path):
    """A server whose engine has the ``qwen3`` reasoning parser, output constraints from the first token
    (``enable_in_reasoning``: a regex can force a reasoning) and compact JSON (the grammar ends a tool call)."""
    from engine.entrypoints.openai.serving import OpenAIServing

    engine = make_async_llm(
        model_path,
        max_num_seqs=4,
        reasoning_parser="qwen3",
        structured_outputs_config={"enable_in_reasoning": True, "disable_any_whitespace": True},
    )
    with serve_models({MODEL: OpenAIServing(engine, MODEL)}) as server:
        yield server.base_url
    engine.shutdown()


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer

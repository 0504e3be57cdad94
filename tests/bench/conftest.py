"""A live in-process OpenAI server for the ``serval bench serve`` tests: the tiny Qwen2 checkpoint's
AsyncLLM behind uvicorn (no Ray), served as ``MODEL``, shared by the session's bench modules."""

from __future__ import annotations

import pytest

from tests.engine.entrypoints.conftest import make_async_llm, serve_models

MODEL = "tiny-bench"


@pytest.fixture(scope="session")
def bench_engine(model_path):
    llm = make_async_llm(model_path)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def bench_url(bench_engine):
    from engine.entrypoints.openai.serving import OpenAIServing

    with serve_models({MODEL: OpenAIServing(bench_engine, MODEL)}) as server:
        yield server.base_url

"""``EngineClient``: both engines a server runs implement it, and the OpenAI layer needs nothing more.

* ``AsyncLLM`` and the PD decode side's ``RemotePrefillEngine`` define every
  member themselves (declaring the protocol as a base must not hide a missing
  one behind the protocol's empty stub), and their ``generate`` accepts every
  argument the protocol's does; ``RemotePrefillEngine`` refuses a LoRA adapter (400) before any prefill.
* The OpenAI layer's modules never import a concrete engine.
* A served request's prompt length is checked once by the engine.
"""

from __future__ import annotations

import ast
import asyncio
import inspect

import pytest

from engine.engine_client import EngineClient
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.inputs import RequestOptions
from engine.lora_request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT

OPENAI_LAYER = REPO_ROOT / "engine" / "entrypoints" / "openai"
# The protocol's members: its methods and properties, and its plain attributes (annotations).
PROTOCOL_MEMBERS = sorted(
    {name for name in vars(EngineClient) if not name.startswith("_")} | set(EngineClient.__annotations__)
)


def members_not_defined_by(client) -> list[str]:
    """The protocol members ``client`` has only through the protocol's own stubs (or not at all)."""

    def is_own(name: str) -> bool:
        if name in vars(client):
            return True
        for klass in type(client).__mro__:
            if klass is EngineClient:
                return False
            if name in vars(klass):
                return True
        return False

    return [name for name in PROTOCOL_MEMBERS if not is_own(name)]


def generate_signature_mismatches(client_class: type, method: str = "generate") -> list[str]:
    """Parameters of ``EngineClient.<method>`` (``generate``, ``encode``) that ``client_class``'s lacks or takes
    differently."""
    implemented = inspect.signature(getattr(client_class, method)).parameters
    mismatches = []
    for name, promised in inspect.signature(getattr(EngineClient, method)).parameters.items():
        given = implemented.get(name)
        if given is None or given.kind != promised.kind or given.default != promised.default:
            mismatches.append(name)
    return mismatches


class _NoMetrics:
    def set_queue(self, value: int) -> None:
        pass


def test_the_protocol_lists_what_servers_call():
    assert PROTOCOL_MEMBERS == sorted(
        [
            "abort",
            "check_health",
            "encode",
            "generate",
            "get_stats",
            "max_model_len",
            "model_config",
            "tokenizer",
            "vocab_size",
        ]
    )


def test_async_llm_implements_engine_client(engine):
    from engine.async_llm import AsyncLLM

    assert isinstance(engine, EngineClient)
    assert EngineClient in AsyncLLM.__mro__  # declared openly, not only matched by shape
    assert members_not_defined_by(engine) == []
    assert generate_signature_mismatches(AsyncLLM) == generate_signature_mismatches(AsyncLLM, "encode") == []
    assert engine.model_config is engine.config.model_config


def test_remote_prefill_engine_implements_engine_client_from_its_local_engine(engine):
    from deployments.pd_config import PDOptions
    from deployments.pd_servers import RemotePrefillEngine

    client = RemotePrefillEngine(engine, prefill_server=None, options=PDOptions(), metrics=_NoMetrics())
    assert isinstance(client, EngineClient) and EngineClient in RemotePrefillEngine.__mro__
    assert members_not_defined_by(client) == []
    assert generate_signature_mismatches(RemotePrefillEngine) == []
    assert generate_signature_mismatches(RemotePrefillEngine, "encode") == []
    assert client.tokenizer is engine.tokenizer and client.model_config is engine.model_config
    assert (client.max_model_len, client.vocab_size) == (engine.max_model_len, engine.vocab_size)
    assert client.get_stats() == engine.get_stats()
    asyncio.run(client.check_health())
    # An embedding needs hidden states, not a remote prefill's KV: the local engine computes it whole.
    prompt, params = {"prompt_token_ids": [5, 6, 7]}, PoolingParams()
    [remote] = asyncio.run(_items(client.encode(prompt, params, "embed-remote")))
    [local] = asyncio.run(_items(engine.encode(prompt, params, "embed-local")))
    assert remote.outputs == local.outputs


def test_remote_prefill_engine_refuses_a_lora_request_before_any_prefill(engine):
    from deployments.pd_config import PDOptions
    from deployments.pd_servers import RemotePrefillEngine

    # No prefill server: a prefill attempt would fail with AttributeError, not the ValueError (400) expected.
    client = RemotePrefillEngine(engine, prefill_server=None, options=PDOptions(), metrics=_NoMetrics())
    stream = client.generate(
        {"prompt_token_ids": [5, 6]}, SamplingParams(), "r", RequestOptions(lora_request=LoRARequest("a", 1, "/a"))
    )
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        asyncio.run(anext(stream))
    assert client.num_waiting_prefills == 0


def test_the_openai_layer_imports_no_concrete_engine():
    for path in sorted(OPENAI_LAYER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                assert module not in ("engine.async_llm", "engine.llm_engine", "engine.llm"), (
                    f"{path.name} imports {module}"
                )


async def _items(iterator) -> list:
    return [item async for item in iterator]


def test_a_served_request_checks_its_prompt_length_once(serving, monkeypatch):
    """The OpenAI layer checks the context itself; the engine's check_prompt_fits then runs once, in the
    scheduler (wherever a module imported it, every copy is counted)."""
    import sys

    from engine.sched import request as core_request

    original = core_request.check_prompt_fits
    calls = []

    def counting_check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
        calls.append(num_prompt_tokens)
        original(num_prompt_tokens, max_model_len)

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "engine" and getattr(module, "check_prompt_fits", None) is original:
            monkeypatch.setattr(module, "check_prompt_fits", counting_check_prompt_fits)
    request = CompletionRequest(prompt=[5, 6, 7], max_tokens=2)
    [response] = asyncio.run(_items(serving.call(Endpoint.COMPLETIONS, request)))
    assert response.usage.prompt_tokens == 3
    assert calls == [3]

"""Shared session fixtures for the end-to-end engine tests (tests/test_llm_*.py).

* ``tiny_checkpoint(arch, tie=None)``: the path of a tiny random-weight
  checkpoint (``serval.tools.make_model``, float32, seed 0), built once per
  session under a temporary directory.
* ``hf_reference(arch, tie=None)``: an :class:`HFReference` around the
  Hugging Face transformers model of that checkpoint (float32, eval), loaded
  once per session, with cached greedy continuations and log-softmaxes.

* ``model_path``: the tiny Qwen2 checkpoint of the serving-shaped tests
  (offline API, AsyncLLM, the OpenAI server, ``serval bench serve``).
* ``smollm2_path``: the real pretrained SmolLM2-135M-Instruct directory
  (``make models``) of the fidelity tests (tests/real_model/); missing, its
  tests fail saying so (never skip).

Plus the engine factories (``engine_kwargs``, ``make_llm``,
``make_async_llm``: one definition, each module binding its own arguments
with ``functools.partial``), plain helpers (``assert_pool_clean``,
``token_prompt``), and the markers (``ray``, ``serve``) put on tests by the
fixtures they use (``pytest_collection_modifyitems``; ``slow`` is explicit).
Everything is built lazily: a test module that never asks for a checkpoint
pays nothing.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import random
import shutil
import sys
import time

# Ray reads this at import: with it, "127.0.0.1" stays loopback instead of being swapped for this
# machine's network address (tests talk to 127.0.0.1 only).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Token auth for every cluster the tests start and join (Ray enables it once a token file exists; a
# driver joining such a cluster presents the token only when the mode is set).
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Without a GPU, Triton kernels run in its interpreter; Triton reads this when it is first imported (and
# some test may import it before the kernel tests do), so it is set here, before any test module loads.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.sampling_params import SamplingParams

ARCH_NAMES = ("llama", "mistral", "qwen2", "qwen3")
# Tokens 0..4 are the specials (BOS, EOS, <|im_start|>, <|im_end|>, pad); random prompts avoid them.
FIRST_ORDINARY_TOKEN = 5
TINY_VOCAB = 512


# Every engine the tests build computes in float32 (exact comparisons with references) from seed 0.
BASE_ENGINE_KWARGS = dict(dtype="float32", seed=0)
MODEL_PATH_ARCH = "qwen2"
# Fixtures that start a Ray cluster, and those that also run Ray Serve on it: their tests get the markers
# (``-m "not ray"`` then never starts Ray). Fixtures depending on these count too (pytest's closure).
RAY_FIXTURES = frozenset({"local_ray", "ray_head", "three_node_cluster"})
SERVE_FIXTURES = frozenset({"ray_head"})


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)  # every report written, every other plugin's unconfigure run
def pytest_unconfigure(config) -> None:
    """Ends a run whose process held a Ray driver without C++ static destructors (``os._exit``).

    Ray 2.60's OpenTelemetry metric reader keeps a thread that exports every few seconds for the life of the
    process, long after ``ray.shutdown()``. When an export falls inside ``exit()``'s destructors (torch's take
    seconds in a process this size), it fails, logs, and the log reaches the already destroyed spdlog registry:
    a segfault after every test had passed, which fails the run (CI's core file, gdb: ``RayLog::~RayLog`` under
    ``OpenTelemetryMetricExporter::Export`` while the main thread ran ``__run_exit_handlers``). Nothing is left
    to tear down here: each fixture has stopped what it started."""
    if "ray._raylet" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash.get(_EXIT_STATUS, 0))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        fixture_names = set(getattr(item, "fixturenames", ()))
        if fixture_names & RAY_FIXTURES:
            item.add_marker(pytest.mark.ray)
        if fixture_names & SERVE_FIXTURES:
            item.add_marker(pytest.mark.serve)


def engine_kwargs(**overrides) -> dict:
    """``BASE_ENGINE_KWARGS`` with ``overrides`` on top: a test module's complete engine arguments."""
    return {**BASE_ENGINE_KWARGS, **overrides}


def make_llm(path: str, **overrides):
    """An offline ``LLM`` on ``path`` with exactly ``engine_kwargs(**overrides)``."""
    from engine import LLM

    return LLM(model=path, **engine_kwargs(**overrides))


def make_async_llm(path: str, executor_class=None, *, like_the_server: bool = False, **overrides):
    """An ``AsyncLLM`` on ``path`` with exactly ``engine_kwargs(**overrides)``.

    ``like_the_server``: built as the servers build it (``AsyncLLM.from_engine_args``: vLLM's throughput
    logger on unless ``disable_log_stats``); otherwise with no stat loggers and ``executor_class`` if given.
    """
    from engine.async_llm import AsyncLLM
    from engine.engine_args import EngineArgs

    args = EngineArgs(model=path, **engine_kwargs(**overrides))
    if like_the_server:
        assert executor_class is None, "from_engine_args takes no executor class"
        return AsyncLLM.from_engine_args(args)
    return AsyncLLM(args.create_engine_config(), executor_class)


def checkpoint_name(arch: str, tie: bool | None = None) -> str:
    return arch if tie is None else f"{arch}-{'tied' if tie else 'untied'}"


def random_token_ids(rng: random.Random, length: int, vocab_size: int = TINY_VOCAB) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]


def token_prompt(token_ids) -> dict:
    return {"prompt_token_ids": list(token_ids)}


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Polls ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def assert_pool_clean(llm) -> None:
    """No request left anywhere, the KV pool consistent, and every block back in the free queue."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    scheduler = engine.engine_core.engine_core.scheduler
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.requests, f"requests left in the scheduler: {list(scheduler.requests)}"
    kv = scheduler.kv_cache_manager
    kv.check_integrity()
    assert not kv.req_to_blocks, f"blocks still held by {list(kv.req_to_blocks)}"
    pool = kv.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1, (
        f"{pool.num_free_blocks} free blocks of {pool.num_blocks - 1} usable"
    )


class HFReference:
    """Hugging Face transformers as the reference for one checkpoint (float32, CPU, no padding).

    Results are cached per prompt, so several test modules and configurations
    share one computation.
    """

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.vocab_size = self.model.config.vocab_size
        # transformers 5 renamed the forward's ``past_key_values`` to ``cache``.
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._greedy: dict[tuple, list[int]] = {}
        self._logprobs: dict[tuple, object] = {}

    def greedy(self, prompt_token_ids, max_new_tokens: int) -> list[int]:
        """Greedy continuation (argmax each step, HF's KV cache); EOS does not stop it (``ignore_eos``).

        Equivalent to ``generate(do_sample=False)`` without EOS handling, which
        ``generate`` cannot turn off: it falls back on the checkpoint's
        generation_config.
        """
        import torch
        from transformers import DynamicCache

        key = (tuple(prompt_token_ids), max_new_tokens)
        if key not in self._greedy:
            tokens: list[int] = []
            with torch.no_grad():
                cache = DynamicCache(config=self.model.config)
                input_ids = torch.tensor([list(prompt_token_ids)])
                for _ in range(max_new_tokens):
                    logits = self.model(input_ids, use_cache=True, **{self._cache_kwarg: cache}).logits
                    tokens.append(int(logits[0, -1].argmax()))
                    input_ids = torch.tensor([[tokens[-1]]])
            self._greedy[key] = tokens
        return self._greedy[key]

    def log_softmax(self, token_ids):
        """``[len(token_ids), vocab]`` float32: row ``j`` is the next-token distribution after ``token_ids[:j+1]``."""
        import torch

        key = tuple(token_ids)
        if key not in self._logprobs:
            with torch.no_grad():
                logits = self.model(torch.tensor([list(token_ids)])).logits[0]
            self._logprobs[key] = logits.float().log_softmax(dim=-1)
        return self._logprobs[key]

    def next_token_logits(self, prompt_token_ids):
        import torch

        with torch.no_grad():
            return self.model(torch.tensor([list(prompt_token_ids)])).logits[0, -1].float()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch, tie=None) -> str``: a tiny float32 checkpoint, built once per session."""
    from serval.tools.make_model import make_model

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    paths: dict[tuple, str] = {}

    def get(arch: str, tie: bool | None = None) -> str:
        key = (arch, tie)
        if key not in paths:
            paths[key] = str(
                make_model(
                    root / checkpoint_name(arch, tie),
                    arch=arch,
                    size="tiny",
                    seed=0,
                    dtype="float32",
                    tie_word_embeddings=tie,
                    quiet=True,
                )
            )
        return paths[key]

    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoint):
    """``hf_reference(arch, tie=None) -> HFReference``, loaded once per session."""
    references: dict[tuple, HFReference] = {}

    def get(arch: str, tie: bool | None = None) -> HFReference:
        key = (arch, tie)
        if key not in references:
            references[key] = HFReference(tiny_checkpoint(arch, tie))
        return references[key]

    return get


@pytest.fixture(scope="session")
def model_path(tiny_checkpoint) -> str:
    """The tiny ``MODEL_PATH_ARCH`` checkpoint the serving-shaped tests share."""
    return tiny_checkpoint(MODEL_PATH_ARCH)


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOLLM2_PATH = REPO_ROOT / "models" / "smollm2-135m-instruct"
SMOLLM2_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """``models/smollm2-135m-instruct``: SmolLM2-135M-Instruct as an HF Llama directory (float32), built by
    ``make models``; fails (never skips) when it is missing."""
    missing = [name for name in SMOLLM2_FILES if not (SMOLLM2_PATH / name).is_file()]
    if missing:
        pytest.fail(f"{SMOLLM2_PATH} lacks {', '.join(missing)}: run `make models`", pytrace=False)
    return str(SMOLLM2_PATH)


def greedy(max_tokens: int, **changes) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored), with ``changes`` on top."""
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": max_tokens, **changes})


def wait_until_idle(engine, timeout_s: float = 30.0) -> None:
    """Waits until the engine runs and queues nothing and every KV block is free (no leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.get_stats()
        idle = (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
        if idle and stats.num_free_blocks == stats.num_total_blocks:
            return
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        time.sleep(0.02)


# The session-scoped engines a module's tests may drive, directly or through a server.
ENGINE_FIXTURES = ("engine", "structured_engine", "bench_engine")


@pytest.fixture
def engine_left_idle(request):
    """After the test, every engine fixture it used has nothing running or queued and every KV block free:
    no request or block leaked. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    yield
    for name in ENGINE_FIXTURES:
        if name in request.fixturenames:
            wait_until_idle(request.getfixturevalue(name))

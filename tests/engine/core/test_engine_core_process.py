"""The engine core in its own process (``engine.core.core_proc`` / ``engine.core.core_client``) behind AsyncLLM.

The rest of the suite's AsyncLLM tests (streams, aborts, ``n`` > 1, errors,
stats) run on this path too, since it is the default; these check what only
the split has: a second process that steps on its own, blocks when idle, dies
loudly and never outlives its parent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import LLM, EngineDeadError, RequestOutputKind
from engine.core.core_client import CorePlacement
from engine.core.proc_client import ProcCoreClient
from tests.conftest import REPO_ROOT, engine_kwargs, greedy, make_async_llm, random_token_ids, token_prompt, wait_until

KWARGS = engine_kwargs(max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=8 * 512 // 16 + 1)
REPO = REPO_ROOT


def core_of(llm) -> ProcCoreClient:
    core = llm._frontend.engine.engine_core
    assert isinstance(core, ProcCoreClient)
    return core


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def collect(llm, prompt, params, request_id):
    return [output async for output in llm.generate(prompt, params, request_id)]


@pytest.fixture(scope="module")
def async_llm(model_path):
    llm = make_async_llm(model_path, **KWARGS)
    yield llm
    llm.shutdown()


def test_the_core_steps_in_another_process_and_matches_offline(async_llm, model_path):
    import random

    rng = random.Random(3)
    prompts = [token_prompt(random_token_ids(rng, n)) for n in (5, 40, 17, 90)]
    core = core_of(async_llm)
    assert core.pid != os.getpid() and is_running(core.pid)

    async def body():
        return await asyncio.gather(
            *(collect(async_llm, prompt, greedy(24), f"match-{i}") for i, prompt in enumerate(prompts))
        )

    results = asyncio.run(asyncio.wait_for(body(), 60))
    with LLM(model=model_path, **KWARGS) as offline:
        expected = offline.generate(prompts, greedy(24))
    assert [outputs[-1].outputs[0].token_ids for outputs in results] == [e.outputs[0].token_ids for e in expected]
    core.check_integrity()
    stats = async_llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running_reqs == 0


def test_an_idle_core_blocks_instead_of_spinning(async_llm):
    pid = core_of(async_llm).pid
    time.sleep(0.5)  # whatever the previous test left running has finished
    before = cpu_seconds(pid)
    time.sleep(2.0)
    assert cpu_seconds(pid) - before < 0.2


DELTA = RequestOutputKind.DELTA


def test_aborted_and_cancelled_streams_leave_the_core_consistent(async_llm):
    async def body():
        stream = async_llm.generate(token_prompt([7] * 30), greedy(400, output_kind=DELTA), "x")
        await stream.__anext__()
        await stream.aclose()  # the consumer leaves: the request is aborted in the core
        first = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate(token_prompt([9] * 30), greedy(480, output_kind=DELTA), "y"):
                first.set()

        task = asyncio.create_task(consume())
        # Cancelled while it waits inside the stream, right after its first output (not after a fixed sleep:
        # on an idle machine the tiny model finishes 400 tokens in under 0.2 s, and there was nothing to abort).
        await first.wait()
        task.cancel()
        await async_llm.abort("never-existed")
        deadline = time.monotonic() + 20
        while async_llm.get_stats().num_running_reqs or async_llm.get_stats().num_waiting_reqs:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(body(), 60))
    core_of(async_llm).check_integrity()
    stats = async_llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_aborted_reqs_total >= 2


def test_a_killed_core_fails_open_streams_at_once(model_path):
    llm = make_async_llm(model_path, **KWARGS)
    pid = core_of(llm).pid

    async def body():
        stream = llm.generate(token_prompt([5] * 20), greedy(480, output_kind=RequestOutputKind.DELTA), "doomed")
        await stream.__anext__()
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 5.0
        with pytest.raises(EngineDeadError):
            await llm.generate(token_prompt([5] * 4), greedy(4), "after").__anext__()
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    asyncio.run(asyncio.wait_for(body(), 60))
    llm.shutdown()


def test_the_core_process_exits_with_its_parent(model_path, tmp_path):
    """SIGKILL the front end (no clean-up runs there): its core process follows within seconds."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.conftest import make_async_llm
        llm = make_async_llm({model_path!r}, **{KWARGS!r})
        print(llm._frontend.engine.engine_core.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        core_pid = int(parent.stdout.readline())
        assert is_running(core_pid)
    finally:
        parent.kill()
        parent.wait()
    assert wait_until(lambda: not is_running(core_pid), timeout_s=10.0), "the core process outlived its parent"


def test_torch_threads_follow_the_engines_cpu_share(model_path):
    from engine import EngineArgs
    from engine.async_llm import with_torch_threads

    config = EngineArgs(model=model_path, **KWARGS).create_engine_config()

    def threads(num_cpus, core_process, **device):
        placement = CorePlacement.CHILD_PROCESS if core_process else CorePlacement.THREAD
        changed = (
            config
            if not device
            else dataclasses.replace(config, device_config=config.device_config.model_copy(update=device))
        )
        return with_torch_threads(changed, num_cpus, placement).device_config.num_threads

    assert threads(4, core_process=True) == 4 and threads(4, core_process=False) == 4
    assert threads(1, core_process=True) == 1
    assert threads(None, core_process=True) == (os.cpu_count() or 1)
    assert threads(None, core_process=False) is None  # the worker's own default: every core
    assert threads(4, core_process=True, num_threads=7) == 7  # the user's choice stands


def test_the_core_process_gets_its_niceness_on_every_thread(model_path):
    from engine.async_llm import AsyncLLM
    from engine.engine_args import EngineArgs

    def nicenesses(pid: int) -> set[int]:
        return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}

    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert base <= 17, "this process runs too nice to lower a child's priority further"
    # Lowering a priority needs no privilege; None leaves the core at its parent's.
    for config_niceness, expected in ((None, base), (base + 2, base + 2)):
        args = EngineArgs(model=model_path, **KWARGS, core_niceness=config_niceness)
        llm = AsyncLLM(args.create_engine_config())
        try:
            pid = core_of(llm).pid
            assert len(os.listdir(f"/proc/{pid}/task")) > 1 and nicenesses(pid) == {expected}
            assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the front end keeps its own
            outputs = asyncio.run(collect(llm, token_prompt([5] * 8), greedy(4), "nice"))
            assert len(outputs[-1].outputs[0].token_ids) == 4
        finally:
            llm.shutdown()

"""The offline ``LLM``'s lifecycle: where its Ray cluster listens, and what releasing it frees.

* A fresh interpreter without ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (Ray reads it when first imported)
  starts ``LLM(..., tensor_parallel_size=2)`` on a new local cluster whose every listener is on
  127.0.0.1, and greedy tokens equal the single-device run.
* Then, on that cluster, dropping an ``LLM`` (``del`` and ``gc.collect()``) and leaving a ``with LLM(...)``
  block (``shutdown()`` after it is a no-op) each free the worker actors and remove the placement group, so
  the next engine of the same size (each takes the whole cluster) starts at once.
* In-process (one device, no Ray) the same three release the worker: its weights and KV caches.

The Ray cases run in one subprocess (``python -m tests.cluster.test_llm_lifecycle ray <model>``): one
cluster, and an interpreter that has not imported Ray nor this suite's conftest (which sets the variable
for every test).
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_KWARGS = dict(dtype="float32", seed=0, max_model_len=128, max_num_seqs=4, num_gpu_blocks_override=32)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
SUBPROCESS_TIMEOUT_S = 300
# The lifecycle child lowers the placement-group wait from 120 s: a leaked group fails the next engine fast.
PLACEMENT_WAIT_S = 20.0
RELEASE_WAIT_S = 15.0
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1", "::ffff:127.0.0.1")  # the last: IPv4 loopback on an IPv6 socket


def _greedy_token_ids(llm) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, params, use_tqdm=False)]


# ---- the in-process case (no Ray)


@pytest.mark.parametrize("release", ["del", "shutdown", "with"])
def test_single_device_llm_releases_its_worker(tiny_checkpoint, release):
    from engine import LLM

    llm = LLM(tiny_checkpoint("llama"), **ENGINE_KWARGS)
    executor = llm.llm_engine.engine_core.engine_core.executor
    worker = weakref.ref(executor.worker)
    weight = weakref.ref(next(executor.worker.model_runner.model.parameters()))
    kv_cache = weakref.ref(executor.worker.model_runner.kv_caches[0])
    assert len(_greedy_token_ids(llm)) == len(PROMPTS)
    if release == "del":
        del llm
    elif release == "shutdown":
        llm.shutdown()
        llm.shutdown()
        assert executor.worker is None
    else:
        with llm as entered:
            assert entered is llm
        assert executor.worker is None
    gc.collect()
    assert worker() is None and weight() is None and kv_cache() is None


# ---- the Ray cases, each in a fresh interpreter


def _run_child(case: str, model: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tests.cluster.test_llm_lifecycle", case, model],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{case} child failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return result.stdout


def _env_without(*names: str) -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name not in names}


@pytest.mark.ray
def test_a_tp_llm_starts_ray_on_loopback_and_releasing_it_frees_workers_and_placement_group(tiny_checkpoint):
    env = _env_without("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")
    stdout = _run_child("ray", tiny_checkpoint("llama"), env)
    assert "loopback: ok" in stdout and stdout.count("released: ") == 2, stdout


def _process_tree(root_pid: int) -> set[int]:
    """``root_pid`` and every process descended from it (the local cluster's daemons and workers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError):
                continue  # gone meanwhile
    tree, grew = {root_pid}, True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        except OSError:
            continue
    return inodes


def _listeners_of(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket these processes hold, from /proc/net/tcp{,6}."""
    inodes, found = _socket_inodes(pids), set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # TCP_LISTEN, and one of theirs
                    continue
                address_hex, port_hex = fields[1].split(":")
                raw = bytes.fromhex(address_hex)
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, words), int(port_hex, 16)))
    return found


def _child_loopback(model: str) -> None:
    from engine import LLM

    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ and "ray" not in sys.modules
    with LLM(model, **ENGINE_KWARGS) as llm:
        expected = _greedy_token_ids(llm)
    ray_kwargs = dict(distributed_executor_backend="ray", num_cpus_per_worker=0.5)
    with LLM(model, tensor_parallel_size=2, **ray_kwargs, **ENGINE_KWARGS) as llm:
        import ray

        listeners = _listeners_of(_process_tree(os.getpid()))
        assert listeners, "the cluster's processes hold no listening socket"
        outside = {(address, port) for address, port in listeners if address not in LOOPBACK_ADDRESSES}
        assert not outside, f"listeners off loopback: {sorted(outside)}"
        assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"]
        assert _greedy_token_ids(llm) == expected
    print("loopback: ok", len(listeners), "listeners")


def _wait_released(group, actor_ids: list[str]) -> None:
    """Until the placement group is removed and every worker actor is dead (RELEASE_WAIT_S at most)."""
    import ray
    from ray._private import state  # the actor table without the dashboard, which these clusters omit

    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        group_state = ray.util.placement_group_table(group)["state"]
        actor_states = [state.actors(actor_id)["State"] for actor_id in actor_ids]
        if group_state == "REMOVED" and all(actor_state == "DEAD" for actor_state in actor_states):
            return
        assert time.monotonic() < deadline, f"not released: group {group_state}, actors {actor_states}"
        time.sleep(0.2)


def _start_ray_llm(model: str, **parallel):
    """An LLM that takes all of the cluster's CPUs, so the next one fits only once this one is released."""
    import ray

    from engine import LLM

    start = time.monotonic()
    num_cpus = ray.cluster_resources()["CPU"] / 2  # two workers each
    llm = LLM(model, distributed_executor_backend="ray", num_cpus_per_worker=num_cpus, **parallel, **ENGINE_KWARGS)
    executor = llm.llm_engine.engine_core.engine_core.executor
    handles = (executor.placement_group, [worker._actor_id.hex() for worker in executor.workers])
    assert len(_greedy_token_ids(llm)) == len(PROMPTS)
    print(f"started in {time.monotonic() - start:.1f} s: {parallel}", flush=True)
    return llm, handles


def _child_ray(model: str) -> None:
    """Loopback first (it starts the cluster), then two releases on that cluster."""
    _child_loopback(model)
    import cluster.placement

    cluster.placement.PLACEMENT_GROUP_READY_TIMEOUT_S = PLACEMENT_WAIT_S
    # Dropped: the compiled graph is the control path that also kept its actors alive.
    llm, (group, actor_ids) = _start_ray_llm(model, pipeline_parallel_size=2, ray_compiled_graph=True)
    del llm
    gc.collect()
    _wait_released(group, actor_ids)
    print("released: del", flush=True)
    llm, (group, actor_ids) = _start_ray_llm(model, tensor_parallel_size=2)
    with llm:
        assert len(_greedy_token_ids(llm)) == len(PROMPTS)
    _wait_released(group, actor_ids)  # on leaving the block, while ``llm`` is still referenced
    llm.shutdown()  # idempotent after the block's
    print("released: with, then shutdown", flush=True)


if __name__ == "__main__":
    case, model_dir = sys.argv[1], sys.argv[2]
    {"ray": _child_ray}[case](model_dir)

"""Tensor and pipeline parallelism on CPU (gloo, no Ray): workers in spawned processes match one device.

Each process builds the ``Worker`` of its rank and drives it with its own copy of
the real ``Scheduler`` on the same requests; the output rank's
``ModelRunnerOutput`` reaches every rank's scheduler through
``broadcast_object_list`` (this harness only; the Ray executor returns it to the
one engine core). Greedy tokens must be identical to the single-device run of the
same harness (logprobs and prompt logprobs within 1e-4) for TP=2, PP=2 and
TP=2 x PP=2, on tiny checkpoints with untied and
tied embeddings, for a batch of mixed-length prompts under a small token budget
(prefill chunks and decodes in one step) and a small KV pool (preemption, and
requests resumed with output tokens). Along the way: every rank's per-request
tokens agree with the scheduler's after every step, only the output rank returns
an output, and every TCP socket of every rank is on 127.0.0.1.

Also, without processes: each rank's loaded parameters are exactly its TP slice
of its stage's checkpoint tensors, other stages' tensors are never read, and a
stage still reports its own missing or unexpected weights.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import multiprocessing
import os
import queue
import random
import shutil
import socket
import traceback
from collections import defaultdict

import pytest
import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from tests.conftest import random_token_ids

CASES = [("llama", None), ("qwen3", None), ("llama", True)]  # untied, tied, tied (make_model's defaults first)
LAYOUTS = [pytest.param((2, 1), id="tp2"), pytest.param((1, 2), id="pp2"), pytest.param((2, 2), id="tp2-pp2")]
PROMPT_LENGTHS = (3, 40, 17, 70, 9, 33)
MAX_TOKENS = 12
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
NUM_BLOCKS = 11  # 10 usable blocks for ~240 tokens of requests: preemptions
MAX_NUM_BATCHED_TOKENS = 24  # prompts arrive in chunks, next to other requests' decodes
RANK_TIMEOUT_S = 120
# Logprobs too: prompt logprobs make every TP rank of the last stage compute logits for prompt chunks.
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=2)
LOGPROB_ATOL = 1e-4


def make_config(path: str, tp_size: int = 1, pp_size: int = 1) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model=path, dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, kv_cache_memory_bytes=1 << 20),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=8, max_model_len=MAX_MODEL_LEN
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size),
        device_config=DeviceConfig(device="cpu", num_threads=1),
    )


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [random_token_ids(rng, n) for n in PROMPT_LENGTHS]


# ------------------------------------------------------------------ one rank


def generate(config: EngineConfig, rank: int = 0, init_method: str | None = None) -> dict:
    """Runs the prompts to completion on this rank's worker; what this rank saw."""
    import torch.distributed as dist

    from engine.worker.worker import Worker

    worker = Worker(config, rank=rank, distributed_init_method=init_method)
    worker.init_device()
    worker.load_model()
    assert worker.determine_num_available_blocks() > 0  # the profiling forward, collective with TP
    worker.initialize_cache(NUM_BLOCKS)
    scheduler = Scheduler(config.scheduler_config, config.cache_config)
    for index, prompt in enumerate(prompts()):
        scheduler.add_request(Request(f"req-{index}", prompt, GREEDY, eos_token_id=None))
    output_rank = config.parallel_config.world_size - config.parallel_config.tensor_parallel_size
    tokens: dict[str, list[int]] = defaultdict(list)
    logprobs: dict[str, list[list[float]]] = defaultdict(list)  # top logprobs: sampled tokens, then prompt tokens
    num_resumed_with_outputs = 0
    returned_outputs = set()
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        num_resumed_with_outputs += sum(bool(new.output_token_ids) for new in scheduler_output.scheduled_new_reqs)
        output = worker.execute_model(scheduler_output)
        returned_outputs.add(output is not None)
        if config.parallel_config.world_size > 1:
            shared = [output]
            dist.broadcast_object_list(shared, src=output_rank)
            output = shared[0]
        for core_output in scheduler.update_from_output(scheduler_output, output):
            tokens[core_output.request_id].extend(core_output.new_token_ids)
            for lists in (core_output.new_logprobs, core_output.new_prompt_logprobs):
                logprobs[core_output.request_id].extend(lists.logprobs if lists is not None else [])
        assert_in_sync(worker, scheduler)
    # Every connection the process group made exists by now.
    sockets_off_loopback = tcp_sockets_off_loopback() if config.parallel_config.world_size > 1 else []
    worker.shutdown()
    return {
        "tokens": dict(tokens),
        "logprobs": dict(logprobs),
        "num_preemptions": scheduler.num_preemptions,
        "num_resumed_with_outputs": num_resumed_with_outputs,
        "returned_outputs": returned_outputs,
        "is_output_rank": worker.is_output_rank,
        "sockets_off_loopback": sockets_off_loopback,
    }


def assert_in_sync(worker, scheduler) -> None:
    """Every computed token this rank holds is the scheduler's token at that position."""
    for req_id, state in worker.model_runner.requests.items():
        request = scheduler.requests.get(req_id)
        if request is None:  # finished this step; dropped by the worker at the next one
            continue
        num = state.num_computed_tokens
        assert state.token_ids[:num] == request.all_token_ids[:num], req_id


def tcp_sockets_off_loopback() -> list[str]:
    """This process's TCP sockets (from /proc) whose local address is not loopback; [] when all are."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    offenders, num_found = [], 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[9] not in inodes:
                    continue
                num_found += 1
                address = _proc_net_address(fields[1].split(":")[0])
                if not address.is_loopback:
                    offenders.append(f"{address}:{int(fields[1].split(':')[1], 16)}")
    assert num_found > 0, "no TCP socket found: the check would prove nothing"
    return offenders


def _proc_net_address(hex_address: str):
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-endian
    address = ipaddress.ip_address(raw)
    return (address.ipv4_mapped or address) if address.version == 6 else address


def run_rank(rank: int, tp_size: int, pp_size: int, paths: list[str], init_methods: list[str], results) -> None:
    torch.set_num_threads(1)
    try:
        outcomes = [
            generate(make_config(path, tp_size, pp_size), rank, init_method)
            for path, init_method in zip(paths, init_methods)
        ]
        results.put((rank, outcomes, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


# -------------------------------------------------------------------- harness


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(tp_size: int, pp_size: int, paths: list[str]) -> list[list[dict]]:
    """Spawns one process per rank; returns each rank's outcomes (one per checkpoint), by rank."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    world_size = tp_size * pp_size
    init_methods = [f"tcp://127.0.0.1:{free_port()}" for _ in paths]
    processes = [
        context.Process(target=run_rank, args=(rank, tp_size, pp_size, paths, init_methods, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: list = [None] * world_size
    try:
        for _ in range(world_size):
            rank, outcome, error = results.get(timeout=RANK_TIMEOUT_S)
            assert error is None, f"rank {rank} failed:\n{error}"
            outcomes[rank] = outcome
    except queue.Empty:
        pytest.fail(f"ranks {[r for r, o in enumerate(outcomes) if o is None]} did not finish")
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return outcomes


@pytest.fixture(scope="module")
def single_device(tiny_checkpoint):
    """The same harness on one device, per case."""
    num_threads = torch.get_num_threads()
    try:
        return {case: generate(make_config(tiny_checkpoint(*case))) for case in CASES}
    finally:
        torch.set_num_threads(num_threads)  # init_device set it for this process


def test_single_device_reference_exercises_the_hard_paths(single_device):
    for reference in single_device.values():
        assert len(reference["tokens"]) == len(PROMPT_LENGTHS)
        assert all(len(t) == MAX_TOKENS for t in reference["tokens"].values())
        # One row per sampled token and per prompt token after the first, each sent once despite preemption.
        assert sorted(len(rows) for rows in reference["logprobs"].values()) == sorted(
            MAX_TOKENS + n - 1 for n in PROMPT_LENGTHS
        )
        assert reference["num_preemptions"] > 0
        assert reference["num_resumed_with_outputs"] > 0  # resumed requests carry output tokens


@pytest.mark.slow  # a world of worker processes per layout: 15-30 s each
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_greedy_run_matches_single_device(tiny_checkpoint, single_device, layout):
    tp_size, pp_size = layout
    outcomes = run_world(tp_size, pp_size, [tiny_checkpoint(*case) for case in CASES])
    output_rank = (pp_size - 1) * tp_size
    for rank, rank_outcomes in enumerate(outcomes):
        for case, outcome in zip(CASES, rank_outcomes):
            assert outcome["tokens"] == single_device[case]["tokens"], (case, rank)
            for req_id, expected in single_device[case]["logprobs"].items():
                torch.testing.assert_close(
                    torch.tensor(outcome["logprobs"][req_id]), torch.tensor(expected), atol=LOGPROB_ATOL, rtol=0
                )
            assert outcome["num_preemptions"] == single_device[case]["num_preemptions"]
            assert outcome["is_output_rank"] == (rank == output_rank)
            assert outcome["returned_outputs"] == {rank == output_rank}, "only the output rank returns outputs"
            assert outcome["sockets_off_loopback"] == [], f"rank {rank} has sockets off loopback"


# ------------------------------------------------------------ loading, no processes


def _expected_slice(name: str, checkpoint: dict, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of model parameter ``name``, built from the HF checkpoint tensors."""

    def rows(tensor):  # column-parallel: output rows split
        size = tensor.shape[0] // tp_size
        return tensor[tp_rank * size : (tp_rank + 1) * size]

    def cols(tensor):  # row-parallel: input columns split
        size = tensor.shape[1] // tp_size
        return tensor[:, tp_rank * size : (tp_rank + 1) * size]

    if ".qkv_proj." in name:
        return torch.cat([rows(checkpoint[name.replace("qkv_proj", part)]) for part in ("q_proj", "k_proj", "v_proj")])
    if ".gate_up_proj." in name:
        return torch.cat([rows(checkpoint[name.replace("gate_up_proj", part)]) for part in ("gate_proj", "up_proj")])
    if ".o_proj." in name or ".down_proj." in name:
        return cols(checkpoint[name])
    if name == "lm_head.weight" and name not in checkpoint:  # tied
        return rows(checkpoint["model.embed_tokens.weight"])
    if "embed_tokens" in name or name == "lm_head.weight":
        return rows(checkpoint[name])
    return checkpoint[name]  # norms: replicated


@pytest.mark.parametrize("case", CASES[:2], ids=["llama-untied", "qwen3-tied"])
def test_each_rank_loads_exactly_its_slice_of_its_stage(tiny_checkpoint, case):
    from safetensors.torch import load_file

    from engine.model import get_model
    from engine.model.source import open_model_source

    path = tiny_checkpoint(*case)
    checkpoint = load_file(os.path.join(path, "model.safetensors"))
    for pp_rank in range(2):
        for tp_rank in range(2):
            model = get_model(path, torch.float32, tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank, pp_size=2)
            params = dict(model.named_parameters(remove_duplicate=False))
            layer = f"model.layers.{pp_rank}."  # two layers, one per stage
            assert all(
                name.startswith(layer) or name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
                for name in params
            )
            assert ("model.embed_tokens.weight" in params) == (pp_rank == 0)
            assert ("lm_head.weight" in params) == ("model.norm.weight" in params) == (pp_rank == 1)
            for name, param in params.items():
                assert torch.equal(param, _expected_slice(name, checkpoint, tp_rank, 2)), (name, pp_rank, tp_rank)
            read = {name for name, _ in open_model_source(path).iter_weights(model.wants_weight)}
            assert not any(name.startswith(f"model.layers.{1 - pp_rank}.") for name in read)
            assert ("model.norm.weight" in read) == (pp_rank == 1)


# ------------------------------------------------------------- small contracts


def test_rank_layout_and_stage_split():
    from engine.distributed import ParallelState, get_pp_indices

    states = [ParallelState.for_rank(rank, tp_size=2, pp_size=3) for rank in range(6)]
    assert [(s.pp_rank, s.tp_rank) for s in states] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [s.rank for s in states if s.is_output_rank] == [4]
    assert [s.is_first_stage for s in states] == [True, True, False, False, False, False]
    assert [s.is_last_stage for s in states] == [False, False, False, False, True, True]
    assert [get_pp_indices(7, r, 3) for r in range(3)] == [(0, 2), (2, 5), (5, 7)]  # extra layer before the last
    assert [get_pp_indices(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        get_pp_indices(1, 0, 2)


def test_rendezvous_on_loopback_binds_the_loopback_interface():
    from engine.distributed.interfaces import interface_with_address, local_address_towards

    assert local_address_towards("127.0.0.1", 9) == "127.0.0.1"
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: held by no interface here


def test_cpu_kv_budget_is_shared_by_the_workers_of_one_machine(tiny_checkpoint, monkeypatch):
    """Each of N workers takes 1/N of cpu_kv_cache_fraction of free RAM (they all see the same RAM free)."""
    from engine.worker import worker as worker_module

    path = tiny_checkpoint("llama")
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block_size x kv heads x head_dim x float32
    monkeypatch.setattr(worker_module, "available_cpu_memory_bytes", lambda: 4 * 40 * block_bytes)
    num_blocks = []
    for pp_size in (1, 2):
        config = dataclasses.replace(
            make_config(path, pp_size=pp_size), cache_config=CacheConfig(block_size=BLOCK_SIZE)
        )  # sized from RAM
        # Not joined to a process group: the worker runs the whole model, only the world size differs.
        worker = worker_module.Worker(config, rank=0, distributed_init_method="tcp://127.0.0.1:9")
        worker.model_runner.load_model()
        num_blocks.append(worker.determine_num_available_blocks())
    assert num_blocks == [40, 20]


def test_a_worker_of_several_ranks_needs_a_rendezvous(tiny_checkpoint):
    from engine.worker.worker import Worker

    with pytest.raises(ValueError, match="distributed_init_method"):
        Worker(make_config(tiny_checkpoint("llama"), tp_size=2), rank=1)


def test_a_stage_reports_its_own_missing_and_unexpected_weights(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.model import WeightLoadingError, get_model

    shutil.copytree(tiny_checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    get_model(str(tmp_path), torch.float32, pp_rank=0, pp_size=2)  # layer 1 is not stage 0's
    with pytest.raises(WeightLoadingError, match=r"missing weights \['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        get_model(str(tmp_path), torch.float32, pp_rank=1, pp_size=2)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.mlp.down_proj.weight"] = torch.zeros(64, 128)  # a layer the config does not have
    save_file(tensors, file, metadata={"format": "pt"})
    for pp_rank in range(2):
        with pytest.raises(WeightLoadingError, match=r"unexpected weights \['model\.layers\.2\.mlp"):
            get_model(str(tmp_path), torch.float32, pp_rank=pp_rank, pp_size=2)

"""Pipeline stages on different Ray nodes, simulated with ``ray.cluster_utils.Cluster``.

Three raylets on this machine (all bound to 127.0.0.1), one CPU each: a
PACK placement group of two one-CPU bundles cannot fit on one node, so the
two pipeline stages land on different nodes; greedy tokens must still equal
the single-device run.
"""

from __future__ import annotations

import pytest

from engine import LLM
from tests.cluster.test_ray_executor import ENGINE_KWARGS, _greedy_token_ids
from tests.serve.cluster import LOOPBACK, is_loopback, listening_addresses

NODE_ARGS = dict(num_cpus=1, node_ip_address=LOOPBACK, object_store_memory=80 * 1024 * 1024)


@pytest.fixture(scope="module")
def three_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    listeners_before = listening_addresses()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(**NODE_ARGS)
        ray.init(address=cluster.address, _node_ip_address=LOOPBACK, logging_level="warning", log_to_driver=False)
        yield listeners_before
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_pipeline_stages_on_two_nodes_match_single_device(three_node_cluster, tiny_checkpoint):
    import ray

    single = LLM(tiny_checkpoint("llama"), **ENGINE_KWARGS)
    try:
        expected = _greedy_token_ids(single)
    finally:
        single.shutdown()
    assert len(ray.nodes()) == 3
    llm = LLM(
        tiny_checkpoint("llama"),
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        num_cpus_per_worker=1,
        **ENGINE_KWARGS,
    )
    try:
        workers = llm.llm_engine.engine_core.engine_core.executor.workers
        node_ids = ray.get([worker.node_id.remote() for worker in workers])
        assert node_ids[0] != node_ids[1]
        assert _greedy_token_ids(llm) == expected
        new_listeners = listening_addresses() - three_node_cluster
        assert all(is_loopback(address) for address, _ in new_listeners), new_listeners
    finally:
        llm.shutdown()

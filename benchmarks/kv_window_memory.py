"""KV cache a sliding-window model holds, against full attention on every layer: the engine's own KV cache manager
(``engine/sched/kv_cache_manager.py``) driven as the scheduler drives it, with no model run.

N requests of L prompt tokens each are prefilled together in chunks (``--chunk`` tokens a request a step, as
``max_num_batched_tokens`` splits them), then decode ``--decode`` tokens each; after every step the blocks the
requests hold are counted. Printed per layout (the model's KV cache groups, and one group of all its layers,
full attention): the peak and final blocks, their bytes (a block is ``block_size`` positions of each of its
group's layers, K and V, ``kv_heads x head_dim`` values of ``--dtype-bytes``), and the ratio.

    python benchmarks/kv_window_memory.py models/gemma3-270m --requests 32 --prompt-len 4096
"""

from __future__ import annotations

import argparse

from engine.config import CacheConfig
from engine.model.architecture import Architecture
from engine.sampling_params import SamplingParams
from engine.sched.kv_cache_groups import KVCacheGroup, kv_cache_groups
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request


def held_blocks(manager: KVCacheManager) -> int:
    null = manager.block_pool.null_block
    return sum(1 for groups in manager.req_to_blocks.values() for blocks in groups for b in blocks if b is not null)


def run(groups: tuple[KVCacheGroup, ...], args: argparse.Namespace) -> tuple[int, int]:
    """(peak, final) blocks held by the requests."""
    per_request = -(-(args.prompt_len + args.decode) // args.block_size) * len(groups)
    config = CacheConfig(
        block_size=args.block_size, num_blocks=args.requests * per_request + 1, enable_prefix_caching=False
    )
    manager = KVCacheManager(config, groups)
    requests = [
        Request(f"r{i}", [1000 + (i * 7919 + j) % 50000 for j in range(args.prompt_len)], SamplingParams(), None)
        for i in range(args.requests)
    ]
    peak = 0
    while any(r.num_computed_tokens < args.prompt_len + args.decode for r in requests):
        for r in requests:
            left = args.prompt_len - r.num_computed_tokens
            step = min(args.chunk, left) if left > 0 else 1
            if r.num_computed_tokens >= args.prompt_len + args.decode:
                continue
            if left <= 0:
                r.append_output_token_id(1)  # the token the last step sampled
            assert manager.allocate_slots(r, step) is not None, "the pool is sized for every block"
            r.num_computed_tokens += step
        peak = max(peak, held_blocks(manager))
    return peak, held_blocks(manager)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a checkpoint directory or .gguf file")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2: a float16 cache (GGUF models' default)")
    args = parser.parse_args()
    arch = Architecture.from_model(args.model)
    layouts = {
        "the model's KV cache groups": arch.kv_cache_groups(),
        "full attention on every layer": kv_cache_groups([None] * arch.num_hidden_layers),
    }
    page = args.block_size * 2 * arch.num_key_value_heads * arch.head_dim * args.dtype_bytes  # one layer's block
    windows = sorted({arch.attention_window(i) for i in range(arch.num_hidden_layers)}, key=str)
    print(f"{args.model}: {arch.num_hidden_layers} layers, windows {windows}; {args.requests} requests of")
    print(f"  {args.prompt_len} prompt tokens in chunks of {args.chunk}, then {args.decode} decoded each")
    results = {}
    for label, groups in layouts.items():
        peak, final = run(groups, args)
        layers = max(len(g.layers) for g in groups)  # every block holds a page of each of its group's layers
        results[label] = peak * layers * page
        mib = layers * page / 2**20
        print(f"  {label}: {len(groups)} groups of {layers} layers; peak {peak} blocks = {peak * mib:.0f} MiB,")
        print(f"    at the end {final} blocks = {final * mib:.0f} MiB")
    ours, full = results.values()
    print(f"  the groups hold {ours / full:.1%} of full attention's peak")


if __name__ == "__main__":
    main()

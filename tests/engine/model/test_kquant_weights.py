"""The K-quants (Q4_K, Q5_K, Q6_K: ``engine/model/quantization/kquants.py``) kept as a GGUF file stores them.

* ``dequantize`` is the ``gguf`` package's dequantization bit for bit on random super-blocks (every field's
  every bit pattern). It was also checked once on the 36 K-quant tensors of the registry's Gemma 3 270M
  Q4_K_M file (llama.cpp's quantizer's; docs/lab-notes.md); a test on that file comes with the model (issue
  55: ``make models`` fetches it).
* A tiny Llama written as a GGUF file in the K-quants the way Q4_K_M mixes them (q, k Q4_K with v Q6_K; gate
  Q4_K with up Q5_K; o Q5_K, down Q6_K; a Q6_K embedding tied to the head) keeps every matrix in its file's
  format, the mixed packed layers part by part, within 10 % of the file's size; each layer computes the
  product of its dequantized weight (exactly in torch, within 14-bit activation rounding natively); embedding
  rows are the dequantized rows; tensor-parallel shards are rows or whole super-blocks; and the offline engine
  on the file generates the dequantized model's greedy tokens.
* The native decode stack runs every product (``quant_linear`` by kernel id; a parted layer's runs side by
  side) and gives the layers' tokens and logprobs bit for bit, on that file and on one whose packed layers are
  each in one K-quant.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.kernels.cpu import use_cpu_kernels
from engine.model.layers.linear_method import process_weights_after_loading
from engine.model.quantization import kquants
from engine.model.quantization.blocks import QuantType, dequantize
from engine.model.quantization.parted import PartedBlockMethod
from engine.model.registry import get_model
from tests.conftest import assert_pool_clean
from tests.engine.model.test_gguf_types import gguf_name
from tests.engine.worker.test_native_decode import _generate, _logprobs, _prompts, _runner

K_QUANTS = [q for q in QuantType if q.super_block]
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, LAYERS = 256, 4, 2, 512, 512, 2
# Checkpoint part -> (format, weight scale d): Q4_K_M's mix, a mixed qkv and a mixed gate_up among them.
FORMATS = {
    "self_attn.q_proj": QuantType.Q4_K,
    "self_attn.k_proj": QuantType.Q4_K,
    "self_attn.v_proj": QuantType.Q6_K,
    "self_attn.o_proj": QuantType.Q5_K,
    "mlp.gate_proj": QuantType.Q4_K,
    "mlp.up_proj": QuantType.Q5_K,
    "mlp.down_proj": QuantType.Q6_K,
}
SCALES = {QuantType.Q4_K: 2e-4, QuantType.Q5_K: 1e-4, QuantType.Q6_K: 1e-5}


def _gguf_dequantize(raw: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(raw.numpy(), GGMLQuantizationType[qtype.value]).astype(np.float32)
    return torch.from_numpy(values)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.value)
def test_dequantize_is_ggufs_bit_for_bit_on_random_super_blocks(qtype):
    raw = kquants.random_rows(37, 1024, qtype.value, torch.Generator().manual_seed(0))
    assert raw.shape == (37, qtype.row_bytes(1024)) and qtype.block_weights == 256
    assert torch.equal(dequantize(raw, qtype), _gguf_dequantize(raw, qtype))
    with pytest.raises(ValueError, match="multiple of 256"):
        qtype.row_bytes(576)


UNIFORM = FORMATS | {"self_attn.v_proj": QuantType.Q4_K, "mlp.up_proj": QuantType.Q4_K}


def _write_kquant_llama(path: Path, formats: dict[str, QuantType] = FORMATS) -> None:
    import gguf

    generator = torch.Generator().manual_seed(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS
    rows = {"q_proj": HEADS * head_dim, "k_proj": KV_HEADS * head_dim, "v_proj": KV_HEADS * head_dim}
    matrices = {"model.embed_tokens.weight": (QuantType.Q6_K, VOCAB, HIDDEN)}
    for i in range(LAYERS):
        for part, qtype in formats.items():
            out = rows.get(part.split(".")[1], INTERMEDIATE if part.startswith("mlp.") else HIDDEN)
            out, k = (HIDDEN, INTERMEDIATE) if part == "mlp.down_proj" else (out, HIDDEN)
            matrices[f"model.layers.{i}.{part}.weight"] = (qtype, out, k)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            writer.add_tensor(gguf_name(f"model.layers.{i}.{norm}.weight"), np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor(gguf_name("model.norm.weight"), np.ones(HIDDEN, dtype=np.float32))
    for name, (qtype, out, k) in matrices.items():
        data = kquants.random_rows(out, k, qtype.value, generator, SCALES[qtype]).numpy()
        writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[qtype.value])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kquants") / "tiny-kquants.gguf"
    _write_kquant_llama(path)
    return path


def _products(model):
    layer = model.model.local_layers[1]
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def test_every_matrix_stays_in_its_files_format_within_its_size(kquant_file):
    model = get_model(str(kquant_file))
    qkv, o, gate_up, down = _products(model)
    assert type(qkv.quant_method) is PartedBlockMethod and type(gate_up.quant_method) is PartedBlockMethod
    assert qkv.quant_method.formats == {"q": QuantType.Q4_K, "k": QuantType.Q4_K, "v": QuantType.Q6_K}
    assert gate_up.quant_method.formats == {0: QuantType.Q4_K, 1: QuantType.Q5_K}
    assert (o.quant_method.qtype, down.quant_method.qtype) == (QuantType.Q5_K, QuantType.Q6_K)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.quant_method.qtype is QuantType.Q6_K
    process_weights_after_loading(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    assert abs(weight_bytes - os.path.getsize(kquant_file)) < 0.1 * os.path.getsize(kquant_file)
    assert qkv.weight.numel() == 384 * QuantType.Q4_K.row_bytes(256) + 128 * QuantType.Q6_K.row_bytes(256)


def test_the_load_says_what_it_kept_as_blocks_and_what_it_dequantized(kquant_file, caplog):
    """The start-up line of a load: per stored type, the tensors kept, dequantized and float (two layers of
    seven matrices and two norms, the Q6_K embedding, the final norm)."""
    with caplog.at_level("INFO", logger="engine.model.registry"):
        kept = get_model(str(kquant_file))
        get_model(str(kquant_file), quantization="none")
    first, second = (r.getMessage() for r in caplog.records if r.name == "engine.model.registry")
    assert f"Weights of {kquant_file.name}: " in first
    assert "MB held; kept as blocks: Q4_K 6, Q5_K 4, Q6_K 5; float: F32 5 (float and dequantized" in first
    assert "; dequantized: Q4_K 6, Q5_K 4, Q6_K 5; float: F32 5 (float and dequantized tensors as float32)" in second
    held = float(first.split(": ")[1].split(" MB")[0]) * 1e6
    assert abs(held - os.path.getsize(kquant_file)) < 0.1 * os.path.getsize(kquant_file), (held, kept)


def _dequantized(model_path: Path):
    return get_model(str(model_path), quantization="none")


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_each_layer_computes_its_dequantized_product(kquant_file, native):
    plain = _dequantized(kquant_file)
    with use_cpu_kernels(native):
        model = get_model(str(kquant_file))
        process_weights_after_loading(model)
        for module, reference in zip([*_products(model), model.lm_head], [*_products(plain), plain.lm_head]):
            x = torch.randn(5, reference.weight.shape[1])
            expected = x.double() @ reference.weight.double().T
            got = module(x).double()
            if native:  # 14-bit activations: about 4e-5 of the product's scale
                assert (got - expected).norm() < 2e-4 * expected.norm(), module
            else:
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        ids = torch.tensor([[0, 17, 511], [5, 5, 2]])
        assert torch.equal(model.model.embed_tokens(ids), plain.model.embed_tokens.weight[ids])


def test_tensor_parallel_shards_are_rows_or_whole_super_blocks(kquant_file):
    with use_cpu_kernels(False):
        full = _products(get_model(str(kquant_file)))
        ranks = [_products(get_model(str(kquant_file), tp_rank=rank, tp_size=2)) for rank in range(2)]
    down = full[3].weight  # row-parallel, K = 512: one super-block of each row per rank
    assert torch.equal(torch.cat([r[3].weight for r in ranks], dim=1), down)
    assert not ranks[0][1].quant_method.is_quantized  # o_proj's 128 columns a rank would cut its super-blocks
    gate_up = full[2].weight.reshape(2, INTERMEDIATE, -1)  # column-parallel, padded [gate | up]: rows
    for rank, part in enumerate(ranks):
        halves = part[2].weight.reshape(2, INTERMEDIATE // 2, -1)
        assert torch.equal(halves, gate_up[:, rank * INTERMEDIATE // 2 : (rank + 1) * INTERMEDIATE // 2])
    x = torch.randn(3, INTERMEDIATE // 2)
    part = ranks[1][3]
    torch.testing.assert_close(
        part.quant_method.apply(part, x, None), F.linear(x, dequantize(part.weight, QuantType.Q6_K))
    )


def test_the_engine_on_the_file_generates_the_dequantized_models_tokens(kquant_file, tiny_checkpoint):
    prompts = [[7, 8, 9, 10, 11, 12], [100, 150, 200, 250, 300, 350, 400, 450, 500]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for quantization in ("gguf", "none"):
        llm = LLM(
            model=str(kquant_file),
            tokenizer=tiny_checkpoint("llama"),
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=8 << 20,
            quantization=quantization,
        )
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        assert_pool_clean(llm)
        llm.shutdown()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    "formats, native", [(FORMATS, [-2, 11, -2, 12]), (UNIFORM, [10, 11, 10, 12])], ids=["mixed", "uniform"]
)
def test_the_native_decode_stack_runs_k_quant_layers_bit_for_bit(tmp_path, tiny_checkpoint, formats, native):
    path = tmp_path / "tiny-kquants.gguf"
    _write_kquant_llama(path, formats)
    llm = LLM(
        str(path),
        tokenizer=tiny_checkpoint("llama"),
        max_num_seqs=4,
        kv_cache_memory_bytes=8 << 20,
        enable_prefix_caching=False,  # as test_native_decode's: with a hit the layers' own logprobs move run to run
    )
    stack = _runner(llm).decode_step
    assert stack is not None and stack.weight_formats[:4] == native  # qkv, o, gate_up, down
    for lengths in ([9], [5, 17, 30]):
        prompts = _prompts(VOCAB, lengths)
        for got, want in zip(_generate(llm, prompts, True), _generate(llm, prompts, False), strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert _logprobs(got) == _logprobs(want)
    assert_pool_clean(llm)
    llm.shutdown()

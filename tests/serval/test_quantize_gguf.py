"""``serval quantize-gguf`` (serval/tools/quantize_gguf.py) on the registry's real file
(models/smollm2-135m-instruct.gguf: Q4_1 linears, a Q8_0 token embedding, F32 norms).

* Every block linear is in the requested type, the embedding in ``--embedding-type`` or as stored, the norms
  byte for byte; every metadata field equals the source's but ``general.file_type``, which names the type.
* The dequantized values are within the format's rounding error of the source's (F32: equal).
* Serval's loader opens the output and the offline engine generates from it; the F32 output (the source's
  float values) gives the source's greedy answer.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from engine import LLM, SamplingParams
from engine.model.source import open_model_source
from serval.cli import main as cli_main
from serval.tools.quantize_gguf import LINEAR
from tests.quantized_gguf import SOURCE, quantized_gguf
from tests.real_model.smollm2 import CAPITAL_ANSWER

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
FP16_EPS = 2.0**-11  # fp16's relative rounding of a block's scale (and Q4_1's / Q5_1's min)


def block_bound(values: np.ndarray, qtype: str) -> np.ndarray:
    """The largest error gguf's quantizer makes on each block of 32 of ``values`` [N, K] -> [N, K/32, 1]."""
    blocks = values.reshape(values.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    if qtype == "Q8_0":  # d = amax / 127, q = round(x / d) in [-127, 127]
        return amax / 127 * (0.5 + 127 * FP16_EPS)
    steps = 15 if qtype.startswith("Q4") else 31  # the 4- and 5-bit formats' largest q
    if qtype in ("Q4_0", "Q5_0"):  # d = the signed extreme / -(steps + 1) / 2: the other side clips by one step
        half = (steps + 1) // 2
        return amax / half * (1 + half * FP16_EPS)
    low, high = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)
    return (high - low) / steps * (0.5 + steps * FP16_EPS) + np.abs(low) * FP16_EPS  # d = range / steps, m = min


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The source re-encoded by ``serval quantize-gguf`` with ``flags``: each file made once for the session
    (the checks of its values, the loads of it, and test_quantized_weights' perplexity share it)."""
    return functools.partial(quantized_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def source():
    assert SOURCE.is_file(), "run `make models`"
    return gguf.GGUFReader(str(SOURCE))


@pytest.mark.parametrize("qtype,embedding", [("Q8_0", None), ("Q4_0", "Q4_1"), ("Q5_0", "Q5_1"), ("F32", "F32")])
def test_the_types_metadata_and_values(source, quantized, qtype, embedding):
    flags = ["--type", qtype] + (["--embedding-type", embedding] if embedding else [])
    out = gguf.GGUFReader(str(quantized(*flags)))
    assert [t.name for t in out.tensors] == [t.name for t in source.tensors]
    assert_metadata_equal(source, out, qtype)
    for theirs, ours in zip(source.tensors, out.tensors):
        expected = qtype if LINEAR.fullmatch(theirs.name) else embedding if theirs.name == "token_embd.weight" else None
        if expected is None or expected == theirs.tensor_type.name:
            assert ours.tensor_type == theirs.tensor_type and np.array_equal(ours.data, theirs.data), theirs.name
            continue
        assert ours.tensor_type.name == expected, theirs.name
        was, now = dequantize(theirs.data, theirs.tensor_type), dequantize(ours.data, ours.tensor_type)
        assert now.shape == was.shape
        if expected == "F32":
            assert np.array_equal(now, was), theirs.name
        else:
            error = np.abs(now - was).reshape(now.shape[0], -1, 32)
            assert (error <= block_bound(was, expected) + 1e-7).all(), theirs.name


def assert_metadata_equal(source, out, qtype: str) -> None:
    names = [name for name in source.fields if not name.startswith("GGUF.")]
    assert [name for name in out.fields if not name.startswith("GGUF.")] == names
    for name in names:
        theirs, ours = source.fields[name], out.fields[name]
        if name == "general.file_type":
            file_type = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "F32": 0}[qtype]
            assert (
                ours.contents() == file_type == gguf.LlamaFileType[f"{'ALL' if qtype == 'F32' else 'MOSTLY'}_{qtype}"]
            )
            continue
        assert ours.types == theirs.types and ours.contents() == theirs.contents(), name


def test_serval_loads_the_output_and_f32_answers_as_the_source_does(quantized):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    outputs = {}
    for qtype, flags in (("F32", ("--embedding-type", "F32")), ("Q8_0", ())):
        path = str(quantized("--type", qtype, *flags))
        assert open_model_source(path).hf_config["architectures"] == ["LlamaForCausalLM"]
        llm = LLM(model=path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
        outputs[qtype] = llm.chat([CHAT], greedy, use_tqdm=False)[0].outputs[0]
        llm.shutdown()
    # The source's own greedy answer (tests/real_model: the float directory of the same values says it too).
    assert outputs["F32"].text == CAPITAL_ANSWER and outputs["F32"].finish_reason == "stop"
    assert outputs["Q8_0"].token_ids and outputs["Q8_0"].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kind", ["Q4_K_M", "q6_k"])
def test_a_k_quant_type_is_refused_naming_llama_cpps_quantizer(tmp_path, capsys, kind):
    with pytest.raises(SystemExit) as refused:
        cli_main(["quantize-gguf", str(SOURCE), str(tmp_path / "out.gguf"), "--type", kind])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"{kind.upper()} is written by llama.cpp's quantizer" in err and "llama-quantize" in err
    assert not (tmp_path / "out.gguf").exists()


def test_a_file_that_is_not_gguf_and_the_source_as_output_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all, just bytes")
    assert cli_main(["quantize-gguf", str(bad), str(tmp_path / "out.gguf"), "--type", "Q8_0"]) == 1
    assert "is not a GGUF file" in capsys.readouterr().err
    assert cli_main(["quantize-gguf", str(SOURCE), str(SOURCE), "--type", "Q8_0"]) == 1
    assert "must not be the source" in capsys.readouterr().err

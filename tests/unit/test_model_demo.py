"""The demo checkpoints (Clover and SDAR): deterministic, small, in the published layout, with a
working tokenizer, and loadable by transformers (Clover: its trunk, by ``Qwen3_5MoeForCausalLM``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from worker.model.checkpoint import load_checkpoint
from worker.model.demo import demo_config, write_demo_checkpoint
from worker.model.demo_tokenizer import SPECIAL_TOKENS
from worker.model.tokenizer import Tokenizer

LAYOUT = {
    "config.json",
    "generation_config.json",
    "manifest.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module", params=["clover", "sdar"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(
        tmp_path_factory.mktemp("demo") / "a", seed=0, size="tiny", arch=request.param
    )


def _arch(folder: Path) -> str:
    return (
        "clover" if json.loads((folder / "config.json").read_text())["model_type"] == "clover_moe" else "sdar"
    )


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_layout_and_size(tiny: Path) -> None:
    assert {p.name for p in tiny.iterdir()} == LAYOUT
    assert sum(p.stat().st_size for p in tiny.iterdir()) <= 5 * 1024 * 1024
    modes = {p.name: p.stat().st_mode & 0o777 for p in tiny.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]  # readable by whoever reads the JSON
    config = json.loads((tiny / "config.json").read_text())
    assert {"mask_token_id", "block_size", "eos_token_id"} <= set(config)
    if _arch(tiny) == "sdar":
        assert config["architectures"] == ["Qwen3MoeForCausalLM"]
        assert config["mlp_only_layers"]  # the dense path is exercised too
    else:
        assert config["architectures"] == ["CloverMoeModelLM"]
        assert set(config["layer_types"]) == {"linear_attention", "full_attention"}  # both mixers


def test_same_seed_is_byte_identical_other_seed_differs(tiny: Path, tmp_path: Path) -> None:
    again = write_demo_checkpoint(tmp_path / "b", seed=0, size="tiny", arch=_arch(tiny))  # type: ignore[arg-type]
    assert _files(again) == _files(tiny)
    other = write_demo_checkpoint(tmp_path / "c", seed=1, size="tiny", arch=_arch(tiny))  # type: ignore[arg-type]
    assert _files(other)["model.safetensors"] != _files(tiny)["model.safetensors"]
    assert _files(other)["tokenizer.json"] == _files(tiny)["tokenizer.json"]


def test_transformers_loads_it_with_the_same_logits(tiny: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers: a test extra (make test)")
    if _arch(tiny) == "sdar":
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    else:  # the trunk under transformers' own model type; the preview tensors are left unused
        trunk = tmp_path / "trunk"
        shutil.copytree(tiny, trunk)
        config = json.loads((trunk / "config.json").read_text())
        config.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
        (trunk / "config.json").write_text(json.dumps(config))
        hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(str(trunk), dtype=torch.float32).eval()
    ours = load_checkpoint(tiny).model
    ids = torch.arange(3, 19)[None]  # [1, 16]
    pos = torch.arange(16)[None]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert (ours(ids, pos, pos) - ref).abs().max().item() < 1e-4


def test_tokenizer_round_trip_and_special_ids(tiny: Path) -> None:
    tok = Tokenizer.from_dir(tiny)
    text = "The clover has four leaves. Numbers: 42!"
    assert tok.decode(tok.encode(text)) == text
    for special in SPECIAL_TOKENS:
        assert tok.token_id(special) is not None
    assert tok.mask_token_id == tok.token_id("<|mask|>")
    assert tok.eos_token_ids[0] == tok.token_id("<|im_end|>")
    assert tok.token_id("<|endoftext|>") in tok.eos_token_ids
    assert tok.pad_token_id == tok.token_id("<|pad|>")
    assert (tok.think_start_id, tok.think_end_id) == (tok.token_id("<think>"), tok.token_id("</think>"))
    assert tok.encode("<|im_start|>user")[0] == tok.token_id("<|im_start|>")
    assert tok.decode([tok.mask_token_id], skip_special_tokens=True) == ""


def test_chat_template_enable_thinking(tiny: Path) -> None:
    tok = Tokenizer.from_dir(tiny)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    thinking = tok.render_chat(messages, enable_thinking=True)
    plain = tok.render_chat(messages, enable_thinking=False)
    assert thinking.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert "<|im_start|>assistant\nHello!<|im_end|>\n" in thinking  # old reasoning dropped
    assert thinking.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert plain == thinking + "<think>\n\n</think>\n\n"
    no_prompt = tok.render_chat(messages, enable_thinking=True, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_untrained_model_predicts_varied_tokens(tiny: Path) -> None:
    loaded = load_checkpoint(tiny)
    tok = loaded.tokenizer
    prompt = tok.encode(
        tok.render_chat([{"role": "user", "content": "Tell me a story."}], enable_thinking=False)
    )
    ids = torch.tensor([prompt + [tok.mask_token_id] * 8])  # [1, T]
    pos = torch.arange(ids.shape[1])[None]
    logits = loaded.model(ids, pos, pos // 4)
    predicted = logits[0, len(prompt) :].argmax(-1)
    assert len(set(predicted.tolist())) >= 4
    assert tok.mask_token_id not in predicted.tolist()
    assert loaded.config.vocab_size == tok.vocab_size
    probs = torch.softmax(logits[0, -1], -1)
    assert 0.01 < probs.max().item() < 0.99


@pytest.mark.parametrize("arch", ["clover", "sdar"])
def test_small_size_has_the_advertised_parameter_counts(arch: str) -> None:
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    config, dtype = demo_config("small", special_ids=ids, arch=arch)  # type: ignore[arg-type]
    total, active = config.param_counts()
    assert 50e6 <= total <= 100e6
    assert 10e6 <= active <= 25e6
    assert dtype == torch.bfloat16

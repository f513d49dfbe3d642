"""Loading Clover checkpoints: what is refused, and the defaults read when the config is silent."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model.checkpoint import CheckpointError, load_checkpoint, read_config
from worker.model.family import decoding_defaults
from worker.model.manifest import write_manifest


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder: Path, *, drop: tuple[str, ...] = (), **config: object) -> None:
    """Edit config.json (keys set or dropped) and re-sign the folder's manifest."""
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    for key in drop:
        data.pop(key, None)
    (folder / "config.json").write_text(json.dumps(data))
    write_manifest(folder)


@pytest.mark.parametrize(
    "tensor",
    ["conv_right_weight", "bd_softmax_logit_scale", "bd_softmax_history_bias", "bd_softmax_history_c"],
)
def test_a_missing_preview_tensor_is_refused_by_name(
    demo_checkpoint: Path, tmp_path: Path, tensor: str
) -> None:
    folder = _copy(demo_checkpoint, tmp_path / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    name = f"model.layers.0.linear_attn.{tensor}"
    del weights[name]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(folder)
    with pytest.raises(CheckpointError, match=f"missing tensors: {name}"):
        load_checkpoint(folder)


def test_conv_right_weight_in_both_shapes(demo_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy(demo_checkpoint, tmp_path / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    for name in [n for n in weights if n.endswith("conv_right_weight")]:
        weights[name] = weights[name][:, None, :].contiguous()  # [C, 1, K-1]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(folder)
    a, b = load_checkpoint(demo_checkpoint).model, load_checkpoint(folder).model
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_a_plain_qwen3_5_moe_is_not_a_diffusion_model(demo_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy(demo_checkpoint, tmp_path / "ckpt")
    _rewrite(folder, model_type="qwen3_5_moe")
    with pytest.raises(CheckpointError, match="not a diffusion model"):
        load_checkpoint(folder)


def test_vision_and_mtp_tensors_are_ignored_once_in_the_log(
    demo_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(demo_checkpoint, tmp_path / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    weights["mtp.layers.0.input_layernorm.weight"] = torch.zeros(4)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(folder)
    with caplog.at_level(logging.INFO, logger="worker.model.checkpoint"):
        load_checkpoint(folder)
    lines = [r.getMessage() for r in caplog.records if "vision/MTP" in r.getMessage()]
    assert len(lines) == 1 and "2 vision/MTP tensors" in lines[0]


def test_family_defaults_when_the_config_is_silent(demo_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy(demo_checkpoint, tmp_path / "ckpt")
    _rewrite(folder, drop=("block_size", "mask_token_id"))
    gen = json.loads((folder / "generation_config.json").read_text())
    for key in ("block_size", "mask_token_id"):
        gen.pop(key)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    write_manifest(folder)
    config = read_config(folder)
    assert config.block_size == 32
    assert config.mask_token_id == 476  # the tokenizer's <|mask|>
    defaults = decoding_defaults(config)
    assert (defaults.block_size, defaults.strategy, defaults.threshold) == (32, "dynamic", 0.95)
    assert defaults.steps_for(32) == 32 and defaults.steps_for(8) == 8  # steps = the block's size


def test_nested_text_config_is_read(demo_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy(demo_checkpoint, tmp_path / "ckpt")
    flat = json.loads((folder / "config.json").read_text())
    outer = {k: flat.pop(k) for k in ("model_type", "architectures", "mask_token_id", "block_size")}
    (folder / "config.json").write_text(json.dumps({**outer, "text_config": flat}))
    write_manifest(folder)
    assert read_config(folder) == read_config(demo_checkpoint)

"""Checkpoint verification and loading errors: every bad file or tensor is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import cli
from worker.model.checkpoint import CheckpointError, load_checkpoint
from worker.model.config import ConfigError, ModelConfig
from worker.model.demo import write_demo_checkpoint
from worker.model.manifest import ManifestError, check_manifest, write_manifest


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", seed=0, size="tiny", arch="sdar")


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _shard(folder: Path) -> None:
    """Split model.safetensors into two shards with an index, then rewrite the manifest."""
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    write_manifest(folder)


def test_clean_checkpoint_verifies_and_cli_says_ok(ckpt: Path) -> None:
    assert check_manifest(ckpt) == []
    result = CliRunner().invoke(cli, ["model", "verify", str(ckpt)])
    assert result.exit_code == 0, result.output


def test_corrupted_shard_is_named_and_refused(ckpt: Path) -> None:
    _shard(ckpt)
    load_checkpoint(ckpt)  # sharded and intact: loads
    _flip_byte(ckpt / "model-00002-of-00002.safetensors", 5000)
    _flip_byte(ckpt / "tokenizer.json", 10)
    problems = {p.path: p.reason for p in check_manifest(ckpt)}
    assert problems == {
        "model-00002-of-00002.safetensors": "sha256 mismatch",
        "tokenizer.json": "sha256 mismatch",
    }
    result = CliRunner().invoke(cli, ["model", "verify", str(ckpt)])
    assert result.exit_code == 1
    assert "model-00002-of-00002.safetensors" in result.output and "tokenizer.json" in result.output
    with pytest.raises(ManifestError, match=r"model-00002-of-00002\.safetensors"):
        load_checkpoint(ckpt)


def test_sharded_demo_loads_like_the_single_file(ckpt: Path, pristine: Path) -> None:
    _shard(ckpt)
    ids = torch.arange(2, 14)[None]
    pos = torch.arange(12)[None]
    single = load_checkpoint(pristine).model(ids, pos, pos // 4)
    sharded = load_checkpoint(ckpt).model(ids, pos, pos // 4)
    assert torch.equal(single, sharded)


def test_missing_and_truncated_files_are_named(ckpt: Path) -> None:
    (ckpt / "generation_config.json").unlink()
    (ckpt / "config.json").write_text("{}")
    problems = {p.path: p.reason for p in check_manifest(ckpt)}
    assert problems["generation_config.json"] == "missing"
    assert problems["config.json"].startswith("size 2 != ")
    assert (ckpt / "manifest.json").exists()
    (ckpt / "manifest.json").unlink()
    assert [p.path for p in check_manifest(ckpt)] == ["manifest.json"]


def test_skip_verify_loads_a_folder_that_fails_verification(ckpt: Path) -> None:
    (ckpt / "tokenizer_config.json").write_text((ckpt / "tokenizer_config.json").read_text() + " ")
    with pytest.raises(ManifestError):
        load_checkpoint(ckpt)
    assert load_checkpoint(ckpt, verify=False).config.num_experts == 8


def _rewrite_tensor(folder: Path, name: str, value: torch.Tensor | None) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_wrong_shape_tensor_is_named(ckpt: Path) -> None:
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite_tensor(ckpt, name, torch.zeros(64, 63))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight.*\[64, 63\]"
    ):
        load_checkpoint(ckpt, verify=False)


def test_missing_and_unexpected_tensors_are_named(ckpt: Path) -> None:
    _rewrite_tensor(ckpt, "model.layers.1.self_attn.k_norm.weight", None)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.9.mlp.gate.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, verify=False)
    assert "missing tensors: model.layers.1.self_attn.k_norm.weight" in str(info.value)
    assert "unexpected tensors: model.layers.9.mlp.gate.weight" in str(info.value)


def test_config_accepts_published_name_variants() -> None:
    base = {
        "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_experts_per_tok": 2,
    }  # fmt: skip
    sdar = ModelConfig.from_hf_dict(
        {
            **base,
            "model_type": "sdar_moe",
            "num_experts": 4,
            "rope_theta": 5e5,
            "mask_token_id": 7,
            "block_size": 4,
        }
    )
    hf5 = ModelConfig.from_hf_dict(
        {**base, "num_local_experts": 4, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    )
    assert (sdar.num_experts, sdar.rope_theta, sdar.head_dim) == (4, 5e5, 8)
    assert (hf5.num_experts, hf5.rope_theta) == (4, 5e5)
    assert (sdar.mask_token_id, sdar.block_size) == (7, 4)
    assert ModelConfig.from_hf_dict({**base, "num_experts": 4, "eos_token_id": [1, 2]}).eos_token_ids == (
        1,
        2,
    )
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama"})
    with pytest.raises(ConfigError, match="rope_type"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("tied", [False, True])
def test_param_counts_match_the_built_model(pristine: Path, tied: bool) -> None:
    import dataclasses

    from worker.model.block_causal_model import BlockCausalForBlockDiffusion
    from worker.model.checkpoint import read_config

    config = dataclasses.replace(read_config(pristine), tie_word_embeddings=tied, attention_bias=True)
    with torch.device("meta"):
        model = BlockCausalForBlockDiffusion(config)
    total, active = config.param_counts()
    assert total == sum(p.numel() for p in model.parameters())
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    idle_experts = len(config.moe_layers) * (config.num_experts - config.num_experts_per_tok)
    assert total - active == idle_experts * expert + (0 if tied else config.vocab_size * config.hidden_size)

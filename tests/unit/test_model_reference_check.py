"""`cloverq model verify --reference DIR`: our causal trunk against a folder's own modeling code.

The stand-in remote-code folders are written here: a config class subclassing transformers'
``Qwen3_5MoeTextConfig`` under a new ``model_type`` and a model class subclassing
``Qwen3_5MoeForCausalLM``, named by ``auto_map`` in a config.json of Clover-35B-A3B's real sizes
(the check shrinks them), so the code under test really imports them from the folder's files.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli

CONFIG_PY = """
from transformers import Qwen3_5MoeTextConfig


class StandInCloverConfig(Qwen3_5MoeTextConfig):
    model_type = "stand_in_clover"
"""

MODELING_PY = """
import torch
from torch import nn
from transformers import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

from .configuration_stand_in import StandInCloverConfig

BROKEN = {broken!r}
PREVIEW_TENSORS = {preview!r}


class FlippedNorm(Qwen3_5MoeRMSNorm):
    def forward(self, x):
        return (self._norm(x.float()) * (1.0 - self.weight.float())).type_as(x)


class StandInCloverLM(Qwen3_5MoeForCausalLM):
    config_class = StandInCloverConfig

    def __init__(self, config):
        super().__init__(config)
        if BROKEN == "norm":  # the final norm with the sign of its offset flipped
            self.model.norm = FlippedNorm(config.hidden_size, eps=config.rms_norm_eps)
        if BROKEN == "extra":  # a tensor our model has no place for
            self.model.extra_scale = nn.Parameter(torch.ones(1))
        for layer in self.model.layers:
            if BROKEN == "attention" and hasattr(layer, "self_attn"):  # attention output x 1.01
                layer.self_attn.register_forward_hook(lambda m, a, out: (out[0] * 1.01, *out[1:]))
            if PREVIEW_TENSORS and hasattr(layer, "linear_attn"):  # Clover's four, unused causally
                la, k, hv = layer.linear_attn, config.linear_conv_kernel_dim, config.linear_num_value_heads
                la.conv_right_weight = nn.Parameter(torch.zeros(la.conv_dim, 1, k - 1))
                la.bd_softmax_logit_scale = nn.Parameter(torch.ones(hv))
                la.bd_softmax_history_bias = nn.Parameter(torch.zeros(hv))
                la.bd_softmax_history_c = nn.Parameter(torch.zeros(hv))
"""

# Clover-35B-A3B-Preview's published shape (CLOVER.md), under the stand-in's model type
REAL_SHAPE = {
    "architectures": ["StandInCloverLM"],
    "model_type": "stand_in_clover",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "pad_token_id": 248044,
    "eos_token_id": 248046,
    "dtype": "bfloat16",
}
AUTO_MAP = {
    "AutoConfig": "configuration_stand_in.StandInCloverConfig",
    "AutoModelForCausalLM": "modeling_stand_in.StandInCloverLM",
}
DIFF = re.compile(r"^(PASS|FAIL) +max \|logit difference\| (\S+)", re.MULTILINE)


def _stand_in(folder: Path, *, broken: str = "", preview: bool = False, auto_map: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "configuration_stand_in.py").write_text(CONFIG_PY)
    (folder / "modeling_stand_in.py").write_text(MODELING_PY.format(broken=broken, preview=preview))
    config = dict(REAL_SHAPE, **({"auto_map": AUTO_MAP} if auto_map else {}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _verify(folder: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["model", "verify", "--reference", str(folder)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _max_diff(output: str) -> tuple[str, float]:
    match = DIFF.search(output)
    assert match, output
    return match.group(1), float(match.group(2))


@pytest.mark.parametrize("preview", [False, True], ids=["trunk", "with-preview-tensors"])
def test_matching_reference_passes(tmp_path: Path, preview: bool) -> None:
    pytest.importorskip("transformers", reason="transformers: a test extra (make test)")
    code, output = _verify(_stand_in(tmp_path / "ref", preview=preview))
    assert code == 0, output
    verdict, diff = _max_diff(output)
    assert verdict == "PASS" and diff < 1e-4
    assert "modeling_stand_in.StandInCloverLM" in output
    assert f"block-diffusion tensors {'yes' if preview else 'no'}" in output
    assert "tiny model 4 layers (3 linear, 1 full attention), hidden 64" in output  # shrunk
    assert not any(k.startswith("_cloverq_reference_") for k in sys.modules)  # imports undone


@pytest.mark.parametrize("broken", ["norm", "attention"])
def test_broken_reference_fails_with_the_difference(tmp_path: Path, broken: str) -> None:
    pytest.importorskip("transformers", reason="transformers: a test extra (make test)")
    code, output = _verify(_stand_in(tmp_path / "ref", broken=broken))
    assert code == 1, output
    verdict, diff = _max_diff(output)
    assert verdict == "FAIL" and diff > 1e-3


def test_reference_tensors_that_do_not_fit_ours_fail_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers: a test extra (make test)")
    code, output = _verify(_stand_in(tmp_path / "ref", broken="extra"))
    assert code == 1
    assert output.strip().count("\n") == 0
    assert output.startswith("FAIL ") and "unexpected tensors: model.extra_scale" in output


def test_folder_without_auto_map_exits_2_in_one_line(tmp_path: Path) -> None:
    code, output = _verify(_stand_in(tmp_path / "ref", auto_map=False))
    assert code == 2
    assert output.strip().count("\n") == 0
    assert "has no auto_map" in output


def test_unimportable_remote_code_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers: a test extra (make test)")
    folder = _stand_in(tmp_path / "ref")
    (folder / "modeling_stand_in.py").write_text("import not_a_module_anywhere\n")
    code, output = _verify(folder)
    assert code == 2
    assert output.strip().count("\n") == 0
    assert "cannot import modeling_stand_in.py" in output and "not_a_module_anywhere" in output


def test_missing_transformers_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    code, output = _verify(_stand_in(tmp_path / "ref"))
    assert code == 2
    assert output.strip().count("\n") == 0
    assert "transformers is not installed" in output


def test_manifest_check_is_unchanged_without_reference(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["model", "verify"])
    assert result.exit_code == 2 and "--reference" in result.output  # usage error: nothing to check
    empty = tmp_path / "empty"
    empty.mkdir()
    assert CliRunner().invoke(cli, ["model", "verify", str(empty)]).exit_code == 1  # no manifest.json

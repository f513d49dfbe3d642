"""``bench.gpu`` (the GPU benchmark) still runs end to end, on CPU at a reduced shape.

No GPU is needed and nothing is timed here: this only keeps the script from rotting between
the rare runs on a GPU machine (the real figures come from ``python -m bench.gpu`` there).
"""

from __future__ import annotations

import pytest
import torch

from bench import gpu

TINY = [
    "--device", "cpu", "--dtype", "float32", "--layers", "2", "--experts", "8", "--top-k", "2",
    "--hidden", "64", "--moe-intermediate", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
    "--vocab", "256", "--batches", "1,3", "--block-sizes", "4,8", "--new-tokens", "8",
    "--prompt-tokens", "5", "--copy-mb", "8",
]  # fmt: skip


def test_defaults_are_the_sdar_30b_a3b_shape() -> None:
    config = gpu.sdar_30b_a3b_config(gpu.parse_args([]))
    assert (config.hidden_size, config.num_hidden_layers, config.num_experts) == (2048, 48, 128)
    assert (config.num_experts_per_tok, config.moe_intermediate_size) == (8, 768)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert config.vocab_size == 151936 and config.eos_token_ids == ()
    args = gpu.parse_args([])
    assert (args.batches, args.block_sizes, args.dtype) == ([1, 8, 64], [4, 32], "bfloat16")


def test_random_model_is_finite_and_routes_to_several_experts() -> None:
    args = gpu.parse_args(TINY)
    model = gpu.build_random_model(
        gpu.sdar_30b_a3b_config(args), device=torch.device("cpu"), dtype=torch.float32
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert 2 <= gpu.distinct_experts_per_layer(model, 16, device=torch.device("cpu")) <= 8


def test_bench_runs_every_configuration_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(TINY) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 4), (3, 4), (1, 8), (3, 8)]
    for row in rows:
        batch, tokens = int(row[0]), int(row[3])
        assert tokens == batch * 8  # every sequence got its new tokens (EOS disabled)
        assert float(row[7]) > 0 and float(row[8]) > 0  # tokens/s, passes/s
    assert "measured device copy" in out


def test_clover_bench_builds_the_35b_a3b_shape_and_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench.gpu_clover``: the real shape's parameter count, and the script end to end at a reduced
    shape (prefill by length, short jobs, decoding) so it cannot rot between GPU runs."""
    from bench import gpu_clover

    total, active = gpu_clover.clover_config(tiny=False).param_counts()
    assert 34e9 < total < 36e9 and 2.5e9 < active < 3.5e9
    tiny = gpu_clover.clover_config(tiny=True)
    model = gpu_clover.build_random_clover(tiny, device=torch.device("cpu"), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == tiny.param_counts()[0]
    args = ["--device", "cpu", "--dtype", "float32", "--tiny", "--lengths", "64,128", "--long", "128",
            "--chunk", "64", "--batches", "1,2", "--new-tokens", "16", "--shorts", "3", "--short-every",
            "0.01", "--prompt-tokens", "8"]  # fmt: skip
    assert gpu_clover.main(args) == 0
    out = capsys.readouterr().out
    assert "[1] prefill" in out and "[2]" in out and "[3] decoding" in out
    decode = [line.split() for line in out.split("[3]")[1].splitlines() if line[:5].strip().isdigit()]
    assert [(int(r[0]), int(r[1])) for r in decode] == [(1, 16), (2, 32)]

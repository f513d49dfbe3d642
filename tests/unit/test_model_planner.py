"""The capacity planner's arithmetic and the `cloverq model` commands (plan, init-demo, verify)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from worker.model.planner import GIB, PlanInput, format_plan, plan, sequences_at_once


def _clover(**overrides: object) -> PlanInput:
    args: dict[str, object] = dict(
        total_params=35e9, active_params=3e9, dtype="bf16", context=32768, batch=64,
        layers=48, kv_heads=4, head_dim=128, attention_heads=32, gpu_memory_gib=141.0, headroom=1.4,
    )  # fmt: skip
    args.update(overrides)
    return PlanInput(**args)  # type: ignore[arg-type]


def test_memory_compute_and_gpu_count() -> None:
    p = plan(_clover())
    bf16, int8, int4 = p.rows
    assert [r.weight_dtype for r in p.rows] == ["bf16", "int8", "int4"]
    assert bf16.weights_gib == pytest.approx(35e9 * 2 / 1024**3)
    assert int8.weights_gib == pytest.approx(bf16.weights_gib / 2)
    assert int4.weights_gib == pytest.approx(bf16.weights_gib / 4)
    assert p.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert bf16.kv_gib == pytest.approx(192.0)  # 96 KiB x 2 Mi positions
    assert bf16.with_headroom_gib == pytest.approx((bf16.weights_gib + 192.0) * 1.4)
    assert bf16.gpus_80gib == 5  # 360 GiB / 80
    assert bf16.gpus_chosen == 3  # 360 GiB / 141
    assert p.flops_per_token == pytest.approx(6e9 + 4 * 48 * 32 * 128 * 32768)


def test_headroom_outside_range_is_refused() -> None:
    with pytest.raises(ValueError, match="headroom"):
        _clover(headroom=2.0)


def test_cli_prints_the_table() -> None:
    result = CliRunner().invoke(
        cli,
        ["model", "plan", "--total-params", "35e9", "--active-params", "3e9", "--dtype", "bf16",
         "--context", "32768", "--batch", "64", "--gpu-memory", "141"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "GPUs@80GiB" in result.output and "GPUs@141GiB" in result.output
    for dtype in ("bf16", "int8", "int4"):
        assert f"\n    {dtype}" in result.output
    # Clover-35B-A3B's shape by default: attention over 10 of 40 layers (16 heads x 256 dims)
    assert "11.37 GFLOP per token" in result.output
    assert "over 10 attention layers" in result.output
    assert "recurrent state 125.6 MiB per sequence" in result.output  # 30 GDN layers, two copies


def test_recurrent_state_is_counted_per_sequence_not_per_position() -> None:
    from worker.model.planner import PlanInput, plan

    base = dict(total_params=1e9, active_params=1e8, dtype="bf16", layers=2, kv_heads=2, head_dim=64,
                attention_heads=4)  # fmt: skip
    plain = plan(PlanInput(context=1000, batch=8, **base))  # type: ignore[arg-type]
    hybrid = plan(PlanInput(context=1000, batch=8, state_bytes_per_sequence=2**30 / 8, **base))  # type: ignore[arg-type]
    longer = plan(PlanInput(context=2000, batch=8, state_bytes_per_sequence=2**30 / 8, **base))  # type: ignore[arg-type]
    assert hybrid.rows[0].kv_gib - plain.rows[0].kv_gib == pytest.approx(1.0)  # 8 sequences x 1/8 GiB
    assert longer.rows[0].kv_gib - hybrid.rows[0].kv_gib == pytest.approx(plain.rows[0].kv_gib)


def test_cli_init_demo_writes_a_verified_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    result = CliRunner().invoke(cli, ["model", "init-demo", str(target), "--seed", "3", "--size", "tiny"])
    assert result.exit_code == 0, result.output
    assert (target / "manifest.json").is_file()
    assert CliRunner().invoke(cli, ["model", "verify", str(target)]).exit_code == 0


def test_cli_plan_tensor_parallel_prints_each_rank(demo_checkpoint: Path) -> None:
    """``--tensor-parallel N``: ``planner.rank_weight_bytes`` per rank and dtype row, rank 0 the largest."""
    from worker.model.checkpoint import read_config
    from worker.model.planner import rank_weight_bytes

    args = ["model", "plan", "--config", str(demo_checkpoint), "--tensor-parallel", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "tensor parallel 2" in result.output
    config = read_config(demo_checkpoint)
    for dtype in ("bf16", "int8", "int4"):
        ranks = [rank_weight_bytes(config, dtype, world=2, rank=r).total for r in range(2)]
        assert ranks[0] > ranks[1] > 0
        assert f"rank 0 {ranks[0]:,} B" in result.output and f"rank 1 {ranks[1]:,} B" in result.output


def test_cli_plan_tensor_parallel_needs_a_config_and_a_split() -> None:
    alone = CliRunner().invoke(cli, ["model", "plan", "--total-params", "1e9", "--active-params", "1e8",
                                     "--tensor-parallel", "2"])  # fmt: skip
    assert alone.exit_code == 2 and "--tensor-parallel needs --config" in alone.output


def test_cli_plan_tensor_parallel_refusal_is_one_line(demo_checkpoint: Path) -> None:
    args = ["model", "plan", "--config", str(demo_checkpoint), "--tensor-parallel", "3"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert "does not split into 3" in result.output and "Traceback" not in result.output


def test_how_many_32k_contracts_fit_per_dtype_and_tensor_parallel_degree() -> None:
    """Clover's shapes, bf16 weights of 65.2 GiB on 141 GiB cards with x1.4 headroom: per 32K-token
    sequence 10 layers x 2 KV heads x 256 x 2 (K, V) x 2 bytes = 20 KiB per position, 640 MiB,
    plus 125.6 MiB of recurrent state; beyond 2 ranks the 2 KV heads are replicated."""
    state = 125.6 * 2**20
    inp = PlanInput(total_params=35e9, active_params=3e9, dtype="bf16", context=32768, batch=1, layers=10,
                    kv_heads=2, head_dim=256, attention_heads=16, state_bytes_per_sequence=state,
                    prefix_cache_bytes=0.5 * GIB, gpu_memory_gib=141.0, headroom=1.4)
    weights = 65.2
    per_sequence = 20 * 1024 * 32768 + state
    room = 141.0 * GIB / 1.4 - weights * GIB - 0.5 * GIB
    assert sequences_at_once(inp, weights, 1) == int(room // per_sequence) == 46
    room_2 = 2 * 141.0 * GIB / 1.4 - weights * GIB - 0.5 * GIB
    assert sequences_at_once(inp, weights, 2) == int(room_2 // per_sequence)
    replicated = 2 * 10 * 4 * 256 * 2 * 32768 + state  # TP 4: four ranks, one KV head each
    room_4 = 4 * 141.0 * GIB / 1.4 - (weights + 0.5) * GIB
    assert sequences_at_once(inp, weights, 4) == int(room_4 // replicated)
    assert sequences_at_once(inp, 500.0, 1) == 0  # weights alone overflow the card: none, never negative
    assert "sequences of 32,768 tokens at once on 141 GiB cards" in format_plan(plan(inp))

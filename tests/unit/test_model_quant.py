"""Weight-only int8/int4 quantization, FP8 block-scaled checkpoints, and the planner's weight bytes.

On the tiny demo checkpoints. Their weights are random, so the top-1 margin of many positions is
small (median top-1 minus top-2 logit ~0.45) and greedy decoding is chaotic: the free-running
tokens of a quantized model part from float32's within a few tokens, and even 0.1 % weight noise
(seven times less than int8's error) or the same weights in bfloat16 (the dtype real checkpoints
ship in) change them within a few dozen. The engine check therefore measures *per-block* greedy
agreement: the float32 engine generates 64 tokens after each of 4 prompts (256 in all, one batch),
then the quantized engine decodes each block of them given the float32 tokens before it (one
request per block, all batched), so one early difference does not decide the rest. Measured
(4 x 64 tokens): int8 0.73 (Clover) / 0.89 (SDAR); bfloat16 weights 0.79 / 0.89; 0.1 % noise
0.96 / 0.98; int4 (group 32) 0.10 / 0.40. The issue's 99 % for int8 needs a trained model's
margins; ``pytest -s`` prints the figures, with the max logit error and the argmax agreement of
one teacher-forced forward (int8: 0.98 / 0.97).

With a trained model's margins: ``python -m bench.quant_trained`` trains each tiny demo briefly on
CPU (600 steps of its block-diffusion objective on templated contracts, ~1.5 min / ~45 s), saves
and reloads it through ``load_checkpoint`` and measures as here (prompts from held-out documents,
4 x 64 tokens). The float32 median top-1 margin goes from 0.48 / 0.37 to 5.87 / 4.68 and int8
per-block greedy agreement to 1.00 / 1.00 (free-running 1.00 / 1.00; 300 steps, margins 2.66 /
1.42: 0.992 / 0.992), so the 99 % is met; int4 group 32: 1.00 / 0.93, group 128 (64 on the tiny
widths): 0.99 / 0.92.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from cli.main import cli
from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model import fp8
from worker.model.checkpoint import SINGLE_NAME, CheckpointError, LoadedModel, load_checkpoint
from worker.model.loader import load_model
from worker.model.manifest import write_manifest
from worker.model.planner import weight_bytes
from worker.model.quant_rules import int4_group, matrix_bytes, parse_mode
from worker.model.quantize import (
    EXPERT_DISPATCH,
    Int4Linear,
    Int8Linear,
    QuantizedExperts,
    dequantize_int4,
    dequantize_int8,
    model_bytes,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_nibbles,
)

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], [8, 9, 10, 11], [42]]
NEW_TOKENS = 64  # per prompt: 256 generated tokens in all, decoded as one batch
PROMPT = PROMPTS[0]


@pytest.fixture(scope="module")
def fp32(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint, dtype=torch.float32)


# --- tensors and modules ----------------------------------------------------------------------------
def test_int8_and_int4_codes_round_trip_within_half_a_step() -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert ((dequantize_int8(q, scale) - w).abs() <= scale.float()[:, None] * 0.51).all()
    codes, sz = quantize_int4(w, 64)
    assert codes.max() <= 15 and sz.shape == (4, 48, 2) and sz.dtype == torch.bfloat16
    step = sz[..., 0].float().T.repeat_interleave(64, dim=1)  # [N, K]
    assert ((dequantize_int4(codes, sz, 64) - w).abs() <= step * 0.51 + 1e-6).all()
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_int4_groups_and_bytes_follow_the_input_width() -> None:
    assert int4_group(2048, 128) == 128
    assert int4_group(224, 128) == 32  # the demo's expert width: 224 = 7 x 32
    assert int4_group(40, 32) is None  # held in int8
    int8, int4 = parse_mode("int8"), parse_mode("int4-g32")
    assert int8 is not None and int4 is not None and int4.group_size == 32
    assert matrix_bytes(64, 256, int8) == 64 * 256 + 2 * 64
    assert matrix_bytes(64, 256, int4) == 64 * 128 + 4 * 64 * 8
    assert matrix_bytes(64, 40, int4) == matrix_bytes(64, 40, int8)
    assert parse_mode(None) is None and parse_mode("") is None


@pytest.mark.parametrize("rows", [1, 5, 40])  # fused kernel (<= 16 rows) and dequantize paths
def test_quantized_linears_match_their_dequantized_weights(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(128, 64, bias=True)
    x = torch.randn(2, rows, 128, generator=gen)
    for module in (Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, 32)):
        if isinstance(module, Int4Linear):
            module.prepare()  # packs for the CPU kernel (64 rows: a multiple of 16)
            reference = dequantize_int4(*quantize_int4(linear.weight.detach(), 32), 32)
        else:
            reference = module.dequantized()
        expected = x @ reference.T + linear.bias
        got = module(x)
        assert got.shape == (2, rows, 64) and got.dtype == torch.float32
        assert torch.allclose(got, expected, atol=2e-2, rtol=1e-2)  # bf16 inputs in the kernels


@pytest.mark.parametrize("kind", ["int8", "int4-g32"])
@pytest.mark.parametrize("dispatch", ["looped", "batched"])
def test_quantized_experts_dispatch_routed_rows(
    kind: str, dispatch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.model.moe import _grouped_matmul

    gen = torch.Generator().manual_seed(1)
    stack = torch.randn(4, 64, 48, generator=gen) / 8  # [E, K, N]
    mode = parse_mode(kind)
    assert mode is not None
    monkeypatch.setitem(EXPERT_DISPATCH, "cpu", dispatch)
    experts = QuantizedExperts(stack, mode)
    experts.prepare()
    assert experts.shape == stack.shape and experts.dispatch == dispatch
    x = torch.randn(9, 64, generator=gen)
    offsets = torch.tensor([3, 3, 8, 9], dtype=torch.int32)  # expert 1 gets no rows
    weights = experts.dequantized() if experts.layout == "plain" else None
    got = _grouped_matmul(x, experts, offsets)  # moe.py hands the rows to the quantized stack
    if weights is None:  # int4 packed for the CPU kernel: compare with the codes' own dequantization
        codes, sz = zip(*(quantize_int4(stack[e].T, 32) for e in range(4)), strict=True)
        weights = torch.stack([dequantize_int4(c, s, 32) for c, s in zip(codes, sz, strict=True)])
    bounds = [0, 3, 3, 8, 9]
    expected = torch.cat([x[bounds[e] : bounds[e + 1]] @ weights[e].T for e in range(4)])
    assert torch.allclose(got, expected, atol=2e-2, rtol=1e-2)


# --- the demo checkpoints: logits, greedy agreement through the engine, memory ----------------------
def _engine(model: torch.nn.Module, lm: LoadedModel) -> Engine:
    engine = Engine(
        model,  # type: ignore[arg-type]
        EngineConfig(max_batch=64, max_len=512),  # every block's request in one batch
        mask_token_id=lm.config.mask_token_id,  # type: ignore[arg-type]
        eos_token_ids=(),  # random weights: never stop early
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


def _free_run(engine: Engine, tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy tokens after each of ``PROMPTS``, all decoded in one batch."""
    params = SamplingParams(max_new_tokens=tokens)
    futures = [engine.submit(GenerationRequest(f"p{i}", p, params)) for i, p in enumerate(PROMPTS)]
    return [f.result(timeout=300).token_ids for f in futures]


def _per_block(engine: Engine, reference: list[list[int]], block: int) -> list[list[int]]:
    """Each block of each ``reference`` decoded given the reference tokens before it, one request per
    block, all submitted at once (blocks are absolute positions: the first one completes the
    prompt's partial block)."""
    futures = []
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        first = -(-len(prompt) // block) * block - len(prompt) or block
        cuts = [0, *range(first, len(ref), block), len(ref)]
        futures.append([
            engine.submit(GenerationRequest("b", prompt + ref[:lo], SamplingParams(max_new_tokens=hi - lo)))
            for lo, hi in itertools.pairwise(cuts)
        ])  # fmt: skip
    return [[t for f in blocks for t in f.result(timeout=300).token_ids] for blocks in futures]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    assert len(pairs) == len(PROMPTS) * NEW_TOKENS
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module", params=["clover", "sdar"])
def two_families(request: pytest.FixtureRequest, demo_checkpoint: Path, sdar_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(demo_checkpoint if request.param == "clover" else sdar_checkpoint)


def test_int8_and_int4_logits_and_greedy_agreement(two_families: LoadedModel) -> None:
    lm = two_families
    block = lm.config.block_size or 4
    engine = _engine(lm.model, lm)
    try:
        reference = _free_run(engine)
    finally:
        engine.stop()
    ids = torch.tensor([PROMPT + reference[0]])  # teacher-forced logits over the float32 tokens
    pos = torch.arange(ids.shape[1])[None]
    logits = lm.model(ids, pos, pos // block)
    results: dict[str, tuple[float, float, float]] = {}
    for mode in ("int8", "int4-g32"):
        model = copy.deepcopy(lm.model)
        quantize_model(model, mode)
        quantized = model(ids, pos, pos // block)
        error = (quantized - logits).abs().max().item()
        new = slice(len(PROMPT), None)  # the generated positions of one teacher-forced forward
        argmax = (quantized[0, new].argmax(-1) == logits[0, new].argmax(-1)).float().mean().item()
        engine = _engine(model, lm)
        try:
            agreement = _agreement(_per_block(engine, reference, block), reference)
        finally:
            engine.stop()
        results[mode] = (error, agreement, argmax)
        top = logits.abs().max().item()
        print(f"{lm.config.family} {mode:>8}: max |dlogit| {error:.3f} (logits up to {top:.1f}), "
              f"per-block greedy agreement {agreement:.3f} over {len(PROMPTS) * NEW_TOKENS} tokens, "
              f"teacher-forced argmax agreement {argmax:.3f}")  # fmt: skip
    # measured int8 per block: 0.73 (Clover) / 0.89 (SDAR), as bfloat16 weights (0.79 / 0.89): see above
    assert results["int8"][1] >= 0.6
    assert results["int8"][2] >= 0.9  # teacher-forced argmax
    assert results["int8"][0] < results["int4-g32"][0]  # int4 is reported (0.10 / 0.40), not gated
    assert results["int8"][1] > results["int4-g32"][1]


def test_per_block_agreement_is_exact_for_the_same_weights(sdar_checkpoint: Path) -> None:
    """The measure above compares like with like: float32 against itself agrees on every token."""
    lm = load_checkpoint(sdar_checkpoint)
    engine = _engine(lm.model, lm)
    try:
        reference = _free_run(engine)
        assert _per_block(engine, reference, lm.config.block_size or 4) == reference
    finally:
        engine.stop()


@pytest.mark.parametrize("mode", ["int8", "int4-g128"])
def test_memory_after_load_matches_the_planner(fp32: LoadedModel, mode: str) -> None:
    model = copy.deepcopy(fp32.model)
    report = quantize_model(model, mode)
    parsed = parse_mode(mode)
    assert parsed is not None
    predicted = weight_bytes(fp32.config, parsed.kind, high_precision="fp32", group_size=parsed.group_size)
    measured = model_bytes(model)
    assert report.bytes_after == measured < report.bytes_before == model_bytes(fp32.model)
    assert abs(measured / predicted.total - 1) < 0.05, (measured, predicted)
    # what stays high precision: embeddings, LM head, norms, routers, GDN gates and taps
    kept = {n for n, _ in model.named_parameters()}
    assert {"embed.weight", "lm_head.weight"} <= kept
    high = ("norm.weight", "router.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias",
            "conv_weight", "conv_right_weight", "shared_expert_gate.weight", "embed.weight", "lm_head.weight",
            "expert_bias")  # fmt: skip
    assert all(n.endswith(high) or ".bd_" in n for n in kept), kept


def test_plan_check_reports_measured_next_to_predicted(demo_checkpoint: Path) -> None:
    result = CliRunner().invoke(
        cli, ["model", "plan", "--check", str(demo_checkpoint), "--dtype", "fp32", "--weight-dtype", "int8",
              "--batch", "2", "--context", "256"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "as fp32 + int8: measured" in result.output and "(+0.00%)" in result.output


def test_worker_setting_quantizes_at_load(demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.infra.settings import Settings

    monkeypatch.setenv("CLOVERQ_WEIGHT_DTYPE", "int4")
    monkeypatch.setenv("CLOVERQ_WEIGHT_GROUP_SIZE", "32")
    settings = Settings()
    loaded = load_model(demo_checkpoint, weight_dtype=settings.model.weight_dtype,
                        group_size=settings.model.weight_group_size, dtype=torch.float32)  # fmt: skip
    kinds = {type(m) for m in loaded.model.modules()}
    assert Int4Linear in kinds and QuantizedExperts in kinds


# --- FP8 block-scaled checkpoints ---------------------------------------------------------------------
def test_fp8_block_dequantization_with_partial_blocks() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    codes, scale_inv = fp8.quantize(w)
    assert codes.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    back = fp8.dequantize(codes, scale_inv, fp8.DEFAULT_BLOCK)
    assert torch.equal(back[128:, 256:], codes[128:, 256:].float() * scale_inv[1, 2])  # the corner block
    assert ((back - w).abs() / w.abs().clamp(min=0.05)).median() < 0.05  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="does not match"):
        fp8.dequantize(codes, scale_inv[:1], fp8.DEFAULT_BLOCK)


def _write_fp8(src: Path, dst: Path, *, drop_scale: bool = False) -> Path:
    """``src`` with every projection and expert matrix stored as Qwen3-FP8 does (``dst``), and the
    float32 checkpoint of the weights the loader must reconstruct (``dst``-dequantized)."""
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    with safe_open(str(src / SINGLE_NAME), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = expected[name] = f.get_tensor(name)
            if name.endswith("proj.weight") and "in_proj_a" not in name and "in_proj_b" not in name:
                codes, scale_inv = fp8.quantize(t)  # tiny matrices: one partial 128 x 128 block
                tensors[name], tensors[fp8.scale_name(name)] = codes, scale_inv
                expected[name] = codes.float() * scale_inv
            else:
                tensors[name] = t
    if drop_scale:
        tensors.pop(next(n for n in tensors if fp8.is_scale(n)))
    reference = dst.with_name(dst.name + "-dequantized")
    for folder, weights in ((dst, tensors), (reference, expected)):
        shutil.copytree(src, folder)
        save_file(weights, str(folder / SINGLE_NAME), metadata={"format": "pt"})
        write_manifest(folder)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    write_manifest(dst)
    return reference


def test_fp8_checkpoint_loads_dequantized_and_requantizes(family_checkpoint: Path, tmp_path: Path) -> None:
    reference = _write_fp8(family_checkpoint, tmp_path / "fp8")
    loaded = dict(load_checkpoint(tmp_path / "fp8", dtype=torch.float32).model.named_parameters())
    expected = dict(load_checkpoint(reference, dtype=torch.float32).model.named_parameters())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[n], expected[n]) for n in loaded)
    ids = torch.tensor([PROMPT])
    pos = torch.arange(len(PROMPT))[None]
    requantized = load_model(tmp_path / "fp8", weight_dtype="int8", dtype=torch.float32)
    assert torch.isfinite(requantized.model(ids, pos, pos // 4)).all()
    _write_fp8(family_checkpoint, tmp_path / "no-scale", drop_scale=True)
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        load_checkpoint(tmp_path / "no-scale")
